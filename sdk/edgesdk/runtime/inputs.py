"""What the runtime checks in a model's inputs before any segment runs, and the casts it does.

A compiled kernel trusts its inputs: an index outside its table reads other memory or crashes the
process, a NaN in an input comes out as confident finite numbers, a cast changes the values without a
word. So every feed is checked against the manifest's `TensorSpec` first:

- names and shapes: exactly the model's (a plain ValueError, as before these checks);
- dtype (the feed's -> the model's):
  - the same dtype passes;
  - a cast numpy calls safe (float16->float32, uint8/int8/int16->float32, int32->int64) is done and noted;
  - a narrowing float cast (float64->float32) is done with a note when every finite value lies within
    the narrower type's range, and refused otherwise;
  - a narrowing integer cast (int64->int32) is done with a note when every value fits, and refused
    naming the first that does not; so is an integer->float cast numpy does not call safe
    (int64->float32) when every value is exactly representable (|v| <= 2^24 for float32);
  - bool, complex, strings and objects, float->integer (token ids given as floats, even integral ones)
    and anything->bool are refused: the values would not mean what the model means;
- non-finite values (NaN, +-inf) in a float input are refused unless the caller allows them;
- an index input (`TensorSpec.valid_range`, set at build time by `edgesdk.ir.index_ranges`) holds only
  values in its range [-N, N-1]: N the size of the table it indexes.

A refusal is an `InputError` (a ValueError) naming the input, what is wrong and the rule, with a hint;
`edgesdk run` reports it as a user error.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from .manifest import TensorSpec

NONFINITE_HINT = ("replace the NaN/inf values, or allow them: BundleModel.run(..., allow_nonfinite=True), "
                  "edgesdk run --allow-nonfinite")


class InputError(ValueError):
    """A feed the model cannot take. `hint` says what the caller can do about it."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


def check_feeds(specs: Iterable[TensorSpec], feeds: dict, *, allow_nonfinite: bool = False
                ) -> tuple[dict[str, np.ndarray], list[str]]:
    """The feeds as arrays of the model's dtypes, and a note for each cast done; raises ValueError
    (names, shapes) or InputError (dtypes, values)."""
    return FeedCheck(specs)(feeds, allow_nonfinite=allow_nonfinite)


class FeedCheck:
    """`check_feeds` for one model's inputs, what it compares with worked out once: a bundle checks the
    feeds of every inference, and on a model of 90 microseconds (Silero VAD) the checks as first written
    took a tenth of its time. A feed of the model's own dtype and shape costs one test of finiteness (and
    one of range, for an index)."""

    def __init__(self, specs: Iterable[TensorSpec]):
        self._each = [(t.name, tuple(t.shape), np.dtype(t.dtype), t.valid_range) for t in specs]
        self._names = frozenset(name for name, *_ in self._each)

    def __call__(self, feeds: dict, *, allow_nonfinite: bool = False) -> tuple[dict[str, np.ndarray], list[str]]:
        if feeds.keys() != self._names:
            missing, extra = sorted(self._names - set(feeds)), sorted(set(feeds) - self._names)
            raise ValueError(f"inputs do not match the model: missing {missing}, unexpected {extra}; "
                             f"the model takes {sorted(self._names)}")
        out, notes = {}, []
        for name, shape, dtype, valid in self._each:
            value = feeds[name]
            if type(value) is not np.ndarray:
                value = np.asarray(value)
            if value.shape != shape:
                raise ValueError(f"input '{name}' has shape {value.shape}, the model takes {shape}")
            if value.dtype != dtype:
                value, note = cast(name, value, dtype)
                if note:
                    notes.append(note)
            if dtype.kind == "f" and not allow_nonfinite and not all_finite(value):
                _check_finite(name, value)
            if valid is not None:
                _check_range(name, value, valid)
            out[name] = value
        return out, notes


def all_finite(value: np.ndarray) -> bool:
    """Whether every value is finite. For float32 and float64, first by the sum of their squares, one BLAS dot: a
    NaN or an infinity makes it NaN or infinite (the terms are never negative: nothing cancels), and finite values
    keep it finite unless it overflows, when the elementwise test decides. Not a ufunc: on a Zen 3,
    `np.isfinite(x).all()` on two small inputs took 4 us and made onnxruntime's next run 11 us slower (Silero VAD,
    a 0.1 ms model: 15 us of its runtime's 30); the dot took 1.3 us and 5."""
    if value.dtype in (np.float32, np.float64):
        flat = value.reshape(-1)
        if math.isfinite(float(flat.dot(flat))):
            return True
    return bool(np.isfinite(value).all())


def cast(name: str, value: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, str]:
    """`value` as `dtype` by the rules in the module docstring, with a note when it was cast."""
    got = value.dtype
    if got == dtype:
        return value, ""
    head = f"input '{name}' is {got}, the model takes {dtype}"
    if got.kind in "bcOUSVMm" or dtype.kind == "b":
        raise InputError(f"{head}: {_kind_name(got)} values are not cast to {_kind_name(dtype)}",
                         f"give {dtype} values")
    if got.kind == "f" and dtype.kind in "iu":
        raise InputError(f"{head}: float values are not cast to integers (indices such as token ids must "
                         f"be given as integers, even when integral)",
                         f"convert them yourself if they are indices: x.astype('{dtype}')")
    if np.can_cast(got, dtype, "safe"):
        return value.astype(dtype), f"{head}: cast to {dtype} (exact)"
    if got.kind == "f" and dtype.kind == "f":
        limit = np.finfo(dtype).max
        finite = np.isfinite(value)
        bad = finite & (np.abs(value) > limit)
        if bad.any():
            raise InputError(_first(f"{head}: a narrowing cast is done only when every finite value lies "
                                    f"within {dtype}'s range (+-{limit:.4g})", value, bad, "outside it"),
                             f"scale the values into {dtype}'s range, or give {dtype} values")
        return value.astype(dtype), f"{head}: narrowed to {dtype} (every value within its range; {dtype} precision)"
    if got.kind in "iu" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        bad = (value < info.min) | (value > info.max)
        if bad.any():
            raise InputError(_first(f"{head}: a narrowing cast is done only when every value fits "
                                    f"[{info.min}, {info.max}]", value, bad, "outside it"),
                             f"give values that fit {dtype}")
        return value.astype(dtype), f"{head}: cast to {dtype} (every value fits)"
    if got.kind in "iu" and dtype.kind == "f":
        exact = 2 ** (np.finfo(dtype).nmant + 1)  # every integer up to 2^(mantissa bits + 1) is a float
        bad = (value > exact) | (value < -exact)
        if bad.any():
            raise InputError(_first(f"{head}: an integer cast to {dtype} is done only when every value is "
                                    f"exactly representable (|v| <= {exact})", value, bad, "beyond that"),
                             f"give {dtype} values")
        return value.astype(dtype), f"{head}: cast to {dtype} (every value exact)"
    raise InputError(f"{head}: no rule casts {got} to {dtype}", f"give {dtype} values")


def _check_finite(name: str, value: np.ndarray) -> None:
    bad = ~np.isfinite(value)
    if bad.any():
        # a compiled kernel need not propagate NaN (a max or clamp may return its other operand, int8
        # quantization makes some integer of it): the outputs would look valid
        raise InputError(_first(f"input '{name}' holds NaN or inf, refused by default", value, bad, "not finite"),
                         NONFINITE_HINT)


def _check_range(name: str, value: np.ndarray, valid: tuple[int, int]) -> None:
    low, high = valid
    if not value.size or (value.min() >= low and value.max() <= high):
        return
    bad = (value < low) | (value > high)
    if bad.any():
        raise InputError(_first(f"input '{name}' is an index into a table, valid range [{low}, {high}]", value, bad,
                                "outside it"),
                         f"give indices in [{low}, {high}] (a negative one counts from the end of the table); "
                         f"token ids must come from the model's own vocabulary")


def _first(message: str, value: np.ndarray, bad: np.ndarray, what: str) -> str:
    """`message`, then the first offending value, its position, and how many more offend."""
    where = np.unravel_index(int(np.argmax(bad)), value.shape)
    more = int(np.count_nonzero(bad)) - 1
    tail = (f", and so {'is' if more == 1 else 'are'} {more} more of the {value.size} values" if more
            else f" (the only one of the {value.size} values)")
    return f"{message}: {value[where].item()!r} at position {tuple(int(i) for i in where)} is {what}{tail}"


def _kind_name(dtype: np.dtype) -> str:
    return {"b": "bool", "c": "complex", "f": "float", "i": "integer", "u": "integer",
            "M": "datetime", "m": "timedelta"}.get(dtype.kind, "string or object")
