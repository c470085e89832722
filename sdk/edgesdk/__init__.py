"""edgesdk: compile a trained model for an industrial edge device and package it as a bundle."""

__version__ = "0.1.0"
