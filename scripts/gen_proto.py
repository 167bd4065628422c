"""Generate the Python code for proto/ into rcoder/v1/ and rcoder/relay/v1/ (``make proto``).

``--check`` generates into a scratch folder and fails when the checked-in
code differs, so a .proto edited without regenerating fails ``make test``.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
# each package of the proto, generated into the Python package of the same path: the daemon's API
# and the relay's (docs/relay.md), each versioned on its own
PACKAGES = (Path("rcoder") / "v1", Path("rcoder") / "relay" / "v1")


def init_text(package: Path) -> str:
    return f'"""Generated from proto/{package.as_posix()} by scripts/gen_proto.py; never edit by hand."""\n'


def generate(out: Path) -> None:
    # protoc finds the mypy plugins by PATH; they sit beside this interpreter.
    bindir = str(Path(sys.executable).parent)
    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    protos = sorted(
        str(p.relative_to(PROTO_ROOT)) for package in PACKAGES for p in (PROTO_ROOT / package).glob("*.proto")
    )
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for package in PACKAGES:
        (out / package / "__init__.py").write_text(init_text(package))


def differences(expected: Path, actual: Path) -> list[str]:
    names = {p.name for p in expected.iterdir() if p.is_file()} | {
        p.name for p in actual.iterdir() if p.is_file() and p.suffix in {".py", ".pyi"}
    }
    return sorted(
        n
        for n in names
        if not (expected / n).exists()
        or not (actual / n).exists()
        or not filecmp.cmp(expected / n, actual / n, shallow=False)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if rcoder/v1 or rcoder/relay/v1 is out of date")
    opts = parser.parse_args()
    if not opts.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        drift = [f"{package}/{name}" for package in PACKAGES
                 for name in differences(Path(tmp) / package, ROOT / package)]  # fmt: skip
    if drift:
        print(f"generated code is out of date ({', '.join(drift)}): run `make proto`", file=sys.stderr)
        return 1
    print("generated code matches proto/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
