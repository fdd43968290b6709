"""Generate the gRPC stubs for ``proto/*.proto`` into ``molt/_proto/``.

Run by the bootstrap script; generated code (with .pyi stubs for the type checker) is not committed,
so it always matches the installed protobuf runtime.
"""

from __future__ import annotations

import pathlib
import sys


def main() -> int:
    from grpc_tools import protoc  # dev dependency

    root = pathlib.Path(__file__).resolve().parent.parent
    out = root / "molt" / "_proto"
    out.mkdir(exist_ok=True)
    (out / "__init__.py").touch()
    protos = sorted((root / "proto").glob("*.proto"))
    for proto in protos:
        args = [
            "protoc",
            f"-I{root / 'proto'}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(proto),
        ]
        if protoc.main(args) != 0:
            print(f"protoc failed on {proto}", file=sys.stderr)
            return 1
    # grpc_tools emits absolute imports ("import x_pb2"); make them package-relative.
    for f in out.glob("*_pb2_grpc.py"):
        text = f.read_text()
        for proto in protos:
            mod = proto.stem + "_pb2"
            text = text.replace(f"import {mod} as", f"from . import {mod} as")
        f.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
