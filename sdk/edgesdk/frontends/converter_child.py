"""The converter process: one TensorFlow-format model to ONNX with tf2onnx, or a PyTorch .pt2 program with
torch.onnx (`torch_export`).

    python -m edgesdk.frontends.converter_child REQUEST.json

Started by `conversion` (see there for why a child). Writes the ONNX file and the result file
that the request names; its stdout and stderr go to a log the user does not see. Every failure
becomes a result, never a traceback: {"ok": false, "kind": "user" | "usage", "code", "message",
"hint", "notes"}. Failures while reading the source are `import.bad-file`, failures inside
tf2onnx `import.convert-failed`.

The request: {"format", "source", "onnx" (the file to write), "result", "batch", "opset",
"input_shapes"}. A reader per format (`READERS`) converts it and returns the result's content;
the steps they share are in `tf2onnx_steps`, the patches of tf2onnx they run with in `tf2onnx_patches`.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

from ..errors import EdgeSDKError, UsageError
from . import keras_file, savedmodel, tflite_file, torch_export
from .tf2onnx_steps import first_line

READERS = {"keras": keras_file.convert, "h5": keras_file.convert, "savedmodel": savedmodel.convert,
           "tflite": tflite_file.convert, "pt2": torch_export.convert}


def main(argv: list[str]) -> int:
    faulthandler.enable()  # on a native crash, the Python frame goes to the log for the parent
    request = json.loads(Path(argv[1]).read_text())
    try:
        result = {"ok": True, **READERS[request["format"]](request)}
    except EdgeSDKError as e:
        result = {"ok": False, "kind": "usage" if isinstance(e, UsageError) else "user", "code": e.code,
                  "message": e.message, "hint": e.hint, "notes": e.notes}
    except BaseException as e:  # noqa: BLE001 - whatever it is, the parent reports it
        if request["format"] == "pt2":
            result = {"ok": False, "kind": "user", "code": "import.convert-failed",
                      "message": f"PyTorch failed to export it: {first_line(e)}",
                      "hint": "torch.onnx.export(torch.export.load(FILE), (), dynamo=True, report=True) shows the full "
                              "error"}
        else:
            result = {"ok": False, "kind": "user", "code": "import.convert-failed",
                      "message": f"tf2onnx failed to convert it: {first_line(e)}",
                      "hint": "the file may be damaged, or hold a construct tf2onnx 1.17 cannot convert; "
                              "`python -m tf2onnx.convert` on it shows the full error"}
    out = Path(request["result"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
