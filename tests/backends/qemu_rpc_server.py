"""A TVM RPC server for an emulated aarch64 board: run by the arm64 rootfs's python3 under qemu-user.

    qemu_rpc_server.py --tracker HOST:PORT --key KEY [--host H] [--port P] [--load-library LIB]

A real board runs `python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY`. That cannot run
under qemu-user without binfmt: `rpc.Server` starts its listener in a `PopenWorker`, a subprocess
of `sys.executable`, which the host kernel cannot exec (an aarch64 binary), and it needs
cloudpickle. This runs the same listener (`_popen_start_rpc_server`, what the worker would run)
in this process; each session is still served in a fork()ed child, which works under qemu-user.
`--load-library .../libtvm_runtime_extra.so` adds the random fill MetaSchedule's runner calls.
"""

import argparse

from tvm.rpc import server

p = argparse.ArgumentParser()
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, default=9090)
p.add_argument("--port-end", type=int, default=9199)
p.add_argument("--tracker", required=True)
p.add_argument("--key", required=True)
p.add_argument("--load-library", default=None)
a = p.parse_args()
host, port = a.tracker.rsplit(":", 1)
bound = server._popen_start_rpc_server(
    a.host, a.port, a.port_end, tracker_addr=(host, int(port)), key=a.key, load_library=a.load_library,
)
print(f"rpc server for key {a.key} listening on {a.host}:{bound}", flush=True)
server.PopenRPCServerState.current.thread.join()
