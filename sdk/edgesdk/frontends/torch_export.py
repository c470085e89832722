"""PyTorch models to ONNX, with PyTorch's own exporter: `torch.export` captures the program, then
`torch.onnx.export(..., dynamo=True)` (onnxscript) translates it at `TORCH_OPSET`. The same pipeline
follows as for any ONNX file. A module the dynamo exporter fails on is traced by the TorchScript exporter
instead, held to the module's outputs on the example inputs (`_traced_to_onnx`).

Two ways in: an `nn.Module` (or an `ExportedProgram`) in memory, from the Python API, exported in the
caller's process (`export`); and a program saved by `torch.export.save` (.pt2), from the command line,
loaded and exported in the converter process (`convert`, a `converter_child` reader: a damaged file
costs an error message, not the build).

A failure is a `UserError` that names the module (its path in the model, `backbone.layer2.0`), the
operation and the line of the model's code where it can be found, with a hint: `import.torch-export`
where `torch.export` cannot capture the program (data-dependent control flow or shapes),
`import.torch-unsupported` where the exporter has no ONNX translation for an op. torch is imported
only here, and only when a PyTorch model is built (`edgesdk[torch]`).
"""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import UsageError, UserError

TORCH_OPSET = 18  # the opset torch.onnx's exporter writes; the import stage's canonical opset is 17 or above
TORCH_VERSION = "2.13.0"  # the version these errors and the exporter's options are written for (constraints.txt)
INSTALL_HINT = "install the torch extra: pip install 'edgesdk[torch]' (the CPU-only wheel is enough)"


def torch_or_error(what: str) -> Any:
    try:
        import torch
    except ImportError:
        raise UsageError("import.no-torch", f"{what} needs PyTorch, which is not installed", INSTALL_HINT) from None
    return torch


def export(model: Any, example_inputs: Any, dest: Path, *, shown: str) -> dict:
    """Write `model` (an `nn.Module` with `example_inputs`, or an `ExportedProgram`) to `dest` as ONNX;
    returns the import's info: {"converter", "notes"}. `shown` names the model in errors."""
    torch = torch_or_error(shown)
    if isinstance(model, torch.export.ExportedProgram):
        program = model
    else:
        if example_inputs is None:
            raise UsageError("import.torch-example-inputs", f"{shown}: a PyTorch module needs example inputs",
                             "give example_inputs=(tensor, ...): a tuple of the tensors forward() takes, in the "
                             "shapes the bundle will run with")
        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
        with _eval_mode(model), _module_trail(torch, model) as trail, _torch_logs_quiet():
            try:
                program = torch.export.export(model, args, strict=False)
            except Exception as e:  # noqa: BLE001 -- whatever torch.export raises, the user gets what and where
                raise _capture_error(e, trail, shown) from None
    version = torch.__version__.split('+')[0]
    try:
        _to_onnx(torch, program, dest, shown)
    except UserError as failed:
        if isinstance(model, torch.export.ExportedProgram):
            raise
        # the dynamo exporter's decompositions fail on some captured programs that run (Swin's attention:
        # "Cannot view a tensor with shape ... and strides ..." once a decomposition changed a tensor's
        # strides): PyTorch's TorchScript exporter traces the module instead, at the example inputs'
        # shapes, which are the shapes the bundle runs with, and is held to the module's own outputs
        if not _traced_to_onnx(torch, model, args, dest):
            raise
        return {"converter": f"torch {version} (torch.onnx TorchScript exporter, opset {TORCH_OPSET})",
                "notes": [f"the dynamo exporter failed ({failed.message}); exported by the TorchScript exporter, "
                          "which agrees with the module on the example inputs"]}
    return {"converter": f"torch {version} (torch.export, torch.onnx dynamo exporter, opset {TORCH_OPSET})",
            "notes": []}


def convert(request: dict) -> dict:
    """The converter process's reader of a .pt2 file (`converter_child.READERS`): the result's content."""
    source = Path(request["source"])
    torch = torch_or_error(f"{source} (a torch.export program)")
    try:
        program = torch.export.load(str(source))
    except Exception as e:  # noqa: BLE001 -- a file torch cannot read: damaged, or not a saved program
        raise UserError("import.bad-file", f"{source} is not a readable torch.export program: "
                        f"{_first_line(e)}", "save it with torch.export.save(torch.export.export(model, "
                        "example_inputs), 'model.pt2') (a TorchScript or state_dict file is not read)") from None
    info = export(program, None, Path(request["onnx"]), shown=str(source))
    return {"converter": info["converter"], "notes": info["notes"]}


def _to_onnx(torch: Any, program: Any, dest: Path, shown: str) -> None:
    import warnings

    try:
        with warnings.catch_warnings(), _torch_logs_quiet():
            warnings.simplefilter("ignore")
            onnx_program = torch.onnx.export(program, (), dynamo=True, opset_version=TORCH_OPSET, optimize=True,
                                             verbose=False, report=False, verify=False)
    except Exception as e:  # noqa: BLE001
        raise _translation_error(e, program, shown) from None
    if onnx_program is None:
        raise UserError("import.torch-unsupported", f"{shown}: torch.onnx wrote no model", _report_hint())
    onnx_program.save(str(dest), external_data=_large(program))


def _traced_to_onnx(torch: Any, model: Any, args: tuple, dest: Path) -> bool:
    """`model` exported by the TorchScript exporter to `dest`, where it can be and onnxruntime's outputs on
    `args` agree with the module's within 1e-4 of each output's largest magnitude (float32 rounding over a
    deep network); False (and `dest` removed) otherwise."""
    import warnings

    import numpy as np
    import onnxruntime as ort

    try:
        with warnings.catch_warnings(), _torch_logs_quiet(), _eval_mode(model), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, args, str(dest), dynamo=False, opset_version=TORCH_OPSET,
                              do_constant_folding=True)
            expected = model(*args)
        expected = [t.detach().numpy() for t in (expected if isinstance(expected, (tuple, list)) else [expected])]
        opts = ort.SessionOptions()
        opts.log_severity_level = 3  # errors only, as every session of the build
        session = ort.InferenceSession(str(dest), opts, providers=["CPUExecutionProvider"])
        feeds = {i.name: a.detach().numpy() for i, a in zip(session.get_inputs(), args)}
        got = session.run(None, feeds)
    except Exception:  # noqa: BLE001 -- it cannot: the dynamo exporter's error is the one the user gets
        dest.unlink(missing_ok=True)
        return False
    agree = len(got) == len(expected) and all(
        g.shape == e.shape and float(np.max(np.abs(g - e), initial=0.0))
        <= 1e-4 * max(float(np.max(np.abs(e), initial=0.0)), 1e-6) for g, e in zip(got, expected))
    if not agree:
        dest.unlink(missing_ok=True)
    return agree


def _large(program: Any) -> bool:
    """Weights past protobuf's 2 GB go to a .data file beside the model (the import stage reads it)."""
    total = sum(t.numel() * t.element_size() for t in program.state_dict.values())
    return total > 1_800_000_000


@contextlib.contextmanager
def _torch_logs_quiet() -> Iterator[None]:
    """torch's own loggers at ERROR, and what it prints on sys.stderr kept, while it exports: what fails is
    raised as our error, with the module and the line, and torch would print the whole captured graph and the
    exporter's steps on stderr first."""
    import io
    import logging

    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    loggers.append(logging.getLogger("torch"))
    levels = [(lg, lg.level) for lg in loggers]
    for lg, _ in levels:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in levels:
            lg.setLevel(level)


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    """Exported in inference mode (dropout off, batch norm with its running statistics), as a bundle runs;
    each submodule's own mode given back after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def _module_trail(torch: Any, model: Any) -> Iterator[list[str]]:
    """The path of each submodule whose forward is running, innermost last, while the program is captured
    (non-strict torch.export runs the module's Python): where a capture fails, the module that failed."""
    trail: list[str] = []
    names = {id(m): name for name, m in model.named_modules()}
    handles = []

    def pre(module, args):
        trail.append(names.get(id(module), type(module).__name__))

    def post(module, args, output):
        if trail:
            trail.pop()

    for m in model.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        yield trail
    finally:
        for h in handles:
            h.remove()


def _capture_error(e: Exception, trail: list[str], shown: str) -> UserError:
    """torch.export could not capture the program: the module it was in, the op, the user's line."""
    where = _module_words(trail[-1] if trail else "")
    line = _user_line(e)
    text = _first_line(e)
    data_dependent = re.search(r"data.dependent|GuardOnDataDependent|Could not guard on data-dependent|"
                               r"Could not extract specialized integer|item\(\)|nonzero|unbacked", str(e), re.I)
    op = _op_of(str(e))
    message = (f"{shown}: torch.export cannot capture {where}" + (f" at {op}" if op else "")
               + (f" ({line})" if line else "") + f": {text}")
    hint = ("the shape or the control flow depends on a tensor's values (a data-dependent slice, .item(), "
            "nonzero): compute it from shapes, or move it out of forward() into pre/post-processing; "
            "torch.export's guide lists the ways (torch._check, torch.cond)" if data_dependent else
            "the module must run under torch.export (non-strict): `torch.export.export(model, example_inputs, "
            "strict=False)` shows the whole error")
    notes = [n for n in _user_frames(e)[-3:]]
    return UserError("import.torch-export", message, hint, notes=notes)


def _translation_error(e: Exception, program: Any, shown: str) -> UserError:
    """The exporter has no ONNX translation for an op of the captured program (or it failed): which op, in
    which module, and why (the innermost cause the exporter chained)."""
    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    text = "\n".join(str(c) for c in chain)
    op = _op_of(text)
    module = ""
    node = re.search(r"translating node\s+%?([\w.]+)", text) or re.search(r"node\s+[`'%]*%?([\w.]+)", text)
    if node is not None:
        for n in program.graph.nodes:
            if n.name == node.group(1):
                stack = n.meta.get("nn_module_stack") or {}
                if stack:
                    module = list(stack.values())[-1][0]
                op = op or str(n.target)
                break
    why = _first_line(chain[-1])
    where = _module_words(module) if module else "the model"
    return UserError("import.torch-unsupported",
                     f"{shown}: torch.onnx (opset {TORCH_OPSET}) cannot translate {where}"
                     + (f" at {op}" if op else "") + f": {type(chain[-1]).__name__}: {why}",
                     _report_hint(op))


def _report_hint(op: str | None = None) -> str:
    return ((f"replace {op} in the model by ops ONNX has (or decompose it), " if op else "")
            + "or export the model to ONNX yourself and build the .onnx; "
            "torch.onnx.export(model, args, dynamo=True, report=True) writes the exporter's full report")


def _module_words(path: str) -> str:
    return f"module '{path}'" if path else "the top module"


def _op_of(text: str) -> str | None:
    m = re.search(r"(aten::[\w.]+|aten\.[\w]+(?:\.[\w]+)?|torch\.ops\.[\w]+\.[\w]+(?:\.[\w]+)?)", text)
    return m.group(1) if m else None


def _user_frames(e: BaseException) -> list[str]:
    """`file:line in function` of the frames in the model's own code (torch's and edgesdk's left out)."""
    frames = []
    for f in traceback.extract_tb(e.__traceback__):
        if "/torch/" in f.filename or "/edgesdk/" in f.filename or f.filename.startswith("<"):
            continue
        frames.append(f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}")
    for m in re.finditer(r'File "([^"]+)", line (\d+), in (\w+)\n\s+(.+)', str(e)):
        if "/torch/" not in m.group(1):
            frames.append(f"{m.group(1)}:{m.group(2)} in {m.group(3)}: {m.group(4).strip()}")
    return list(dict.fromkeys(frames))


def _user_line(e: BaseException) -> str | None:
    frames = _user_frames(e)
    return frames[-1] if frames else None


def _first_line(e: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip().splitlines()  # torch colours its messages
    return (text[0] if text else type(e).__name__)[:300]
