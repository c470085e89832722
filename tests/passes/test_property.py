"""Property: on random small graphs from a grammar of what converters emit, optimize() returns a
valid model with the same signature, no more nodes, and the same outputs.

The grammar grows one NCHW tensor step by step: Conv, BatchNormalization (inference and training
mode), Conv+BN and Conv*s+t, Add/Sub/Mul/Div by constants of every broadcast kind (alone and chained), Relu, Clip, Min/Max, the x*Clip(x+3)/6
HardSwish, Transpose pairs and NHWC sandwiches around elementwise ops, Reshape/Flatten round trips,
Identity, Dropout, x*1, duplicate subexpressions, and intermediate values that are also graph outputs.

Tolerance: rtol 1e-5 and atol 1e-5 x max|output|. Folding BN and constants into Conv weights and
combining constant chains reassociates float sums; the rounding error of a sum scales with the
magnitudes summed (the activations), not with each output element, so the absolute part is taken
relative to the output's scale.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from tests.passes.harness import model, node, optimized, random_feeds, run


class RandomNet:
    def __init__(self, rng: np.random.Generator, channels: int, size: int):
        self.rng, self.c, self.h, self.w = rng, channels, size, size + 1
        self.nodes, self.inits, self.outputs = [], {}, []
        self.cur, self.count = "x", 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def const(self, array) -> str:
        name = self.fresh("k")
        self.inits[name] = np.asarray(array, np.float32)
        return name

    def op(self, op_type: str, inputs: list, **attrs) -> str:
        out = self.fresh("t")
        self.nodes.append(node(op_type, inputs, [out], **attrs))
        return out

    def broadcastable(self) -> np.ndarray:
        """A constant that broadcasts against (1, C, H, W) without growing it."""
        shapes = [(), (1,), (self.c, 1, 1), (1, self.c, 1, 1), (self.h, self.w), (self.w,), (1, 1, self.h, 1)]
        return self.rng.uniform(-2, 2, shapes[self.rng.integers(len(shapes))])

    # --- the grammar's steps -----------------------------------------------------------------

    def conv(self):
        cout, k = int(self.rng.integers(2, 5)), int(self.rng.choice([1, 3]))
        inputs = [self.cur, self.const(self.rng.standard_normal((cout, self.c, k, k)) * 0.5)]
        if self.rng.random() < 0.5:
            inputs.append(self.const(self.rng.standard_normal(cout)))
        self.cur = self.op("Conv", inputs, pads=[k // 2] * 4)
        self.c = cout

    def batchnorm(self, training: bool = False):
        c = self.c
        params = [self.const(self.rng.uniform(0.5, 2, c)), self.const(self.rng.standard_normal(c)),
                  self.const(self.rng.standard_normal(c)), self.const(self.rng.uniform(0.5, 2, c))]
        if training:
            out = self.fresh("t")
            self.nodes.append(node("BatchNormalization", [self.cur, *params], [out, self.fresh("rm"), self.fresh("rv")],
                                   training_mode=1))
            self.cur = out
        else:
            self.cur = self.op("BatchNormalization", [self.cur, *params])

    def batchnorm_training(self):
        self.batchnorm(training=True)

    def conv_batchnorm(self):
        self.conv()
        self.batchnorm()

    def conv_affine(self):
        """tf2onnx's form of a Keras BatchNormalization after a Conv: Mul and Add per channel."""
        self.conv()
        self.cur = self.op("Mul", [self.cur, self.const(self.rng.uniform(0.5, 2, (self.c, 1, 1)))])
        self.cur = self.op("Add", [self.cur, self.const(self.rng.standard_normal((1, self.c, 1, 1)))])

    def arithmetic(self):
        op = str(self.rng.choice(["Add", "Sub", "Mul", "Div"]))
        value = self.broadcastable()
        if op == "Div":
            value = np.sign(value + 1e-3) * (np.abs(value) + 0.5)
        args = [self.cur, self.const(value)]
        if op in ("Add", "Mul") and self.rng.random() < 0.5:
            args.reverse()
        self.cur = self.op(op, args)

    def constant_chain(self):
        self.arithmetic()
        self.arithmetic()

    def relu(self):
        self.cur = self.op("Relu", [self.cur])

    def clip(self):
        lo = float(self.rng.uniform(-3, 1))
        self.cur = self.op("Clip", [self.cur, self.const(lo), self.const(lo + float(self.rng.uniform(0.5, 4)))])

    def min_max(self):
        lo = float(self.rng.uniform(-3, 1))
        self.cur = self.op("Min", [self.op("Max", [self.cur, self.const(lo)]), self.const(lo + 2)])

    def hardswish(self):
        x = self.cur
        clipped = self.op("Clip", [self.op("Add", [x, self.const(3.0)]), self.const(0.0), self.const(6.0)])
        self.cur = self.op("Div", [self.op("Mul", [x, clipped]), self.const(6.0)])

    def transpose_pair(self):
        perm = [0, *(1 + self.rng.permutation(3))]
        inverse = [int(i) for i in np.argsort(perm)]
        self.cur = self.op("Transpose", [self.op("Transpose", [self.cur], perm=perm)], perm=inverse)

    def nhwc_sandwich(self):
        t = self.op("Transpose", [self.cur], perm=[0, 2, 3, 1])
        t = self.op("Relu", [t]) if self.rng.random() < 0.5 else t
        t = self.op("Add", [t, self.const(self.rng.standard_normal(self.c))])
        t = self.op("Mul", [t, self.const(float(self.rng.uniform(0.5, 2)))])
        self.cur = self.op("Transpose", [t], perm=[0, 3, 1, 2])

    def reshape_round_trip(self):
        flat = (self.op("Flatten", [self.cur], axis=1) if self.rng.random() < 0.5 else
                self.op("Reshape", [self.cur, self.shape_const(1, -1)]))
        self.cur = self.op("Reshape", [flat, self.shape_const(1, self.c, self.h, self.w)])

    def shape_const(self, *dims) -> str:
        name = self.fresh("s")
        self.inits[name] = np.array(dims, np.int64)
        return name

    def identity(self):
        self.cur = self.op(str(self.rng.choice(["Identity", "Dropout"])), [self.cur])

    def neutral(self):
        self.cur = self.op("Mul", [self.cur, self.const(1.0)]) if self.rng.random() < 0.5 else \
            self.op("Add", [self.const(np.zeros(self.w)), self.cur])

    def duplicate(self):
        self.cur = self.op("Add", [self.op("Relu", [self.cur]), self.op("Relu", [self.cur])])

    def expose(self):
        if self.cur != "x" and self.cur not in self.outputs:
            self.outputs.append(self.cur)


STEPS = [name for name in vars(RandomNet) if not name.startswith("_")
         and name not in ("fresh", "const", "op", "broadcastable", "shape_const")]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(steps=st.lists(st.sampled_from(STEPS), min_size=1, max_size=8), channels=st.integers(2, 4),
       size=st.integers(3, 5), seed=st.integers(0, 2**32 - 1))
def test_optimized_random_graph_computes_the_same(steps, channels, size, seed):
    net = RandomNet(np.random.default_rng(seed), channels, size)
    for step in steps:
        getattr(net, step)()
    if net.cur == "x":
        net.relu()
    outputs = [o for o in net.outputs if o != net.cur] + [net.cur]
    m = model(net.nodes, {"x": [1, channels, size, size + 1]}, outputs, net.inits)
    out, record = optimized(m)  # valid, same signature, no more nodes, input untouched
    feeds = random_feeds(m, seed % 1000)
    for got, want in zip(run(out, feeds), run(m, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * max(float(np.abs(want).max()), 1e-30))
