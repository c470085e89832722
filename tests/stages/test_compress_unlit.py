"""The compress stage's warning where no real calibration sample raises a detector's scores: its int8 ranges
were calibrated on background alone."""

from __future__ import annotations

import numpy as np

from edgesdk.compression.accuracy import SCORES, VALUES, View
from edgesdk.stages.compress import unlit_scores


def test_scores_no_calibration_sample_raises_are_warned_of():
    parts = {"y": [View("y", VALUES, 1, 0, 4), View("y", SCORES, 1, 4, 6, "sigmoid", class_axis=1)],
             "logits": [View("logits", SCORES, activation="sigmoid", applies=True)],
             "probs": [View("probs", SCORES, activation="softmax", class_axis=1)]}
    y = np.zeros((1, 6, 10), np.float32)
    y[0, :4] = 300.0  # boxes: large values, never scores
    y[0, 4:] = 0.05
    background = [{"y": y, "logits": np.full((1, 8), -6.0, np.float32), "probs": np.full((1, 3), 1 / 3, np.float32)}]
    warned = unlit_scores(background, parts)
    assert len(warned) == 2 and warned[0].startswith("y[:, 4:6]: no calibration sample raises a score above 0.05")
    assert warned[1].startswith("logits: no calibration sample raises a score above 0.00247")  # the sigmoid of -6
    assert all("calibrate on inputs that hold what the model detects" in w for w in warned)
    lit = {**background[0], "y": y.copy(), "logits": np.full((1, 8), 2.0, np.float32)}
    lit["y"][0, 5, 3] = 0.8
    assert unlit_scores(background + [lit], parts) == []
