"""Rewrites that make a graph fit an accelerator: exact ones (`exact`), and ReLU-sum approximations of
unary functions the device lacks (`relu_sum`), each with the error it is allowed; `legalize` runs them
on a whole model for a target (the legalize stage, `edgesdk check`)."""
