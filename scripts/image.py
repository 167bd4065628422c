"""``make image``: build ``localhost/rcoder:<version>`` (tagged ``:latest``) from ``Containerfile``.

Standard library only (it runs before the venv exists). Steps:

1. podman and runc, installed from Debian's packages when missing and we are root (as
   ``make postgres`` does); otherwise it says what to install. mmdebstrap too, when a base is made.
2. ``CONTAINERS_CONF`` is ``deploy/containers.conf`` unless the environment names one: runc and
   cgroupfs, which take the hybrid cgroups crun refuses; the machine's ``/etc`` is never edited.
3. The base: ``--base IMAGE`` (e.g. ``debian:bookworm-slim`` where a registry is reached), else
   ``localhost/rcoder-base:bookworm-<recipe>``, made once from Debian's packages (``mmdebstrap
   --variant=minbase``, slimmed as debian:bookworm-slim is, then ``podman import``): no image
   registry needed.
4. Reuse: the inputs (the Containerfile, the build context's files, the base image's id, the build
   arguments) are hashed into the label ``rcoder.inputs``; an image with that label is tagged
   and nothing is built.
5. Else ``podman build`` with the host's network (Debian's packages, PyPI and npm), the machine's
   CA bundle mounted for pip and npm (a TLS-intercepting proxy's CA is in it where there is one).
6. The machine can run ``deploy/compose.yaml``: under podman's CNI network backend, the dnsname
   plugin its services find each other by, installed like podman when missing.

Prints the image's id as its last line of stdout (the tests run by that id). One build at a time:
a second run waits for the first (a lock file), then finds its image and reuses it - so `make
test` builds in the background while the suite runs, and the image test, run last, waits for it.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPOSITORY = "localhost/rcoder"
INPUTS_LABEL = "rcoder.inputs"
CONTAINERS_CONF = ROOT / "deploy" / "containers.conf"
# the build context (.dockerignore lets in only these): files and folders
CONTEXT = (
    "Containerfile",
    ".dockerignore",
    "pyproject.toml",
    "agents/package.json",
    "agents/package-lock.json",
    "deploy/image-defaults.toml",
)
CONTEXT_DIRS = ("rcoder",)
# Debian 12 with its updates and security fixes, as debian:bookworm-slim has them
DEBIAN_SOURCES = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# as debian:bookworm-slim has it: no documentation, manual pages or translations (the files stay
# in the base, so what later layers install leaves them out too); copyright notices kept
SLIM = (
    "path-exclude=/usr/share/doc/*", "path-include=/usr/share/doc/*/copyright", "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*", "path-exclude=/usr/share/locale/*", "path-exclude=/usr/share/groff/*",
    "path-exclude=/usr/share/lintian/*",
)  # fmt: skip
MMDEBSTRAP = ["--variant=minbase", *(f"--dpkgopt={option}" for option in SLIM), "bookworm"]
# the base made from Debian's packages, named by its recipe: a changed recipe makes a new one
RECIPE = hashlib.sha256(repr((MMDEBSTRAP, DEBIAN_SOURCES)).encode()).hexdigest()[:8]
MADE_BASE = f"localhost/rcoder-base:bookworm-{RECIPE}"
# held while building: one build at a time per user (podman's storage is per user)
LOCK = Path(tempfile.gettempdir()) / f"rcoder-image-{os.getuid()}.lock"
HOST_CA = "/run/host-ca.crt"  # where the build sees the machine's CA bundle


class ImageError(Exception):
    """What stops the build, said so that a person can act on it."""


def version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]["version"])


def podman_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment podman runs with: the project's containers.conf unless one is named."""
    env = dict(os.environ if environ is None else environ)
    env.setdefault("CONTAINERS_CONF", str(CONTAINERS_CONF))
    return env


def podman(*args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["podman", *args], env=podman_env(), text=True, capture_output=capture, check=False, stdin=subprocess.DEVNULL
    )
    if check and done.returncode != 0:
        raise ImageError(f"podman {' '.join(args[:3])} failed ({done.returncode}): {(done.stderr or '').strip()}")
    return done


def ensure_tools(*needed: str) -> None:
    """Install Debian's packages for ``needed`` commands (package = command) when missing."""
    missing = [name for name in needed if shutil.which(name) is None]
    install(missing, why="building the image needs them")
    still = [name for name in missing if shutil.which(name) is None]
    if still:
        raise ImageError(f"installed {' '.join(missing)}, but {', '.join(still)} is still not on PATH")


# where podman 4.3 looks for CNI plugins (containers.conf's cni_plugin_dirs, its default)
CNI_PLUGIN_DIRS = ("/usr/local/libexec/cni", "/usr/libexec/cni", "/usr/local/lib/cni", "/usr/lib/cni", "/opt/cni/bin")
DNSNAME_PACKAGE = "golang-github-containernetworking-plugin-dnsname"


def ensure_compose_network() -> None:
    """deploy/compose.yaml's services reach each other by name (``postgres``, ``rcoder-a``). Under
    podman's CNI network backend, Debian 12's podman 4.3 default, that takes the dnsname plugin,
    a package of its own that podman only recommends; netavark (podman 4.4+) has it built in."""
    backend = podman("info", "--format", "{{.Host.NetworkBackend}}").stdout.strip()
    if backend == "cni" and not any(Path(folder, "dnsname").exists() for folder in CNI_PLUGIN_DIRS):
        install([DNSNAME_PACKAGE], why="deploy/compose.yaml's services find each other by name through it")


def install(packages: Sequence[str], why: str) -> None:
    """Install Debian's ``packages`` when we are root; otherwise say what to install."""
    if not packages:
        return
    names = " ".join(packages)
    if os.geteuid() != 0:
        raise ImageError(
            f"{', '.join(packages)} missing: install Debian's {names} (sudo apt-get install "
            f"--no-install-recommends {names}), or run `make image` as root to have it done"
        )
    print(f"image: installing Debian's {names} ({why})", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ImageError(f"{' '.join(argv[:2])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")


def image_id(reference: str) -> str:
    """The id of a local image ("" when there is none)."""
    done = podman("image", "inspect", "--format", "{{.Id}}", reference, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def ensure_base(base: str) -> str:
    """The base image's id; the Debian-made base is made first when it is the one and missing."""
    found = image_id(base)
    if found:
        return found
    if base != MADE_BASE:
        raise ImageError(f"no local image {base}: pull it first (podman pull {base}), or build on the made base")
    ensure_tools("mmdebstrap")
    print(f"image: making {MADE_BASE} from Debian's packages (mmdebstrap --variant=minbase bookworm)", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rcoder-base-") as folder:
        rootfs = Path(folder) / "rootfs.tar"
        argv = ["mmdebstrap", "--quiet", *MMDEBSTRAP, str(rootfs), *DEBIAN_SOURCES]
        done = subprocess.run(argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise ImageError(f"mmdebstrap failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        podman("import", "--change", 'CMD ["/bin/bash"]', str(rootfs), MADE_BASE)
    print(f"image: {MADE_BASE} made in {time.monotonic() - started:.0f} s", flush=True)
    return image_id(MADE_BASE)


def context_files() -> list[Path]:
    """The files the build context holds (what .dockerignore lets in), sorted."""
    files = [ROOT / name for name in CONTEXT]
    for folder in CONTEXT_DIRS:
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                files.append(path)
    return sorted(files)


def inputs_hash(base_id: str, build_args: Sequence[str]) -> str:
    """What the image is made of: the context's files (names and bytes), base, build arguments,
    and this script (how it builds)."""
    digest = hashlib.sha256()
    for part in (base_id, *build_args):
        digest.update(part.encode() + b"\0")
    for path in [*context_files(), Path(__file__).resolve()]:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:24]


def built_with(inputs: str) -> str:
    """The id of an image built from these inputs ("" when none is)."""
    done = podman("images", "--quiet", "--no-trunc", "--filter", f"label={INPUTS_LABEL}={inputs}")
    ids = done.stdout.split()
    return ids[0] if ids else ""


def ca_bundle() -> str:
    """The machine's CA bundle ("" when it has none where OpenSSL looks)."""
    cafile = ssl.get_default_verify_paths().cafile
    return cafile if cafile and os.path.isfile(cafile) else ""


def build(base: str) -> str:
    """The image's id, built or reused; tagged ``<version>`` and ``latest`` either way. Waits
    while another run of this script builds (``LOCK``)."""
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process ends
        return _build(base)


def _build(base: str) -> str:
    ensure_tools("podman", "runc")
    base_id = ensure_base(base)
    build_args = [f"BASE={base}"]
    mounts: list[str] = []
    if cafile := ca_bundle():
        mounts = ["--volume", f"{cafile}:{HOST_CA}:ro"]
        build_args += [f"PIP_CERT={HOST_CA}", f"NODE_EXTRA_CA_CERTS={HOST_CA}"]
    inputs = inputs_hash(base_id, build_args)
    tags = [f"{REPOSITORY}:{version()}", f"{REPOSITORY}:latest"]
    found = built_with(inputs)
    if found:
        print(f"image: reused {found.removeprefix('sha256:')[:12]} (inputs {inputs} unchanged)", flush=True)
    else:
        print(f"image: building {tags[0]} on {base} (inputs {inputs})", flush=True)
        started = time.monotonic()
        argv = [
            "build", "--format", "docker", "--network", "host", "--layers", "--file", str(ROOT / "Containerfile"),
            "--label", f"{INPUTS_LABEL}={inputs}", "--label", f"org.opencontainers.image.version={version()}",
            *(arg for value in build_args for arg in ("--build-arg", value)), *mounts, str(ROOT),
        ]  # fmt: skip
        podman(*argv, capture=False)
        found = built_with(inputs)
        if not found:
            raise ImageError(f"podman build ended, but no image carries {INPUTS_LABEL}={inputs}")
        print(f"image: built {found.removeprefix('sha256:')[:12]} in {time.monotonic() - started:.0f} s", flush=True)
    for tag in tags:
        podman("tag", found, tag)
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--base",
        default=os.environ.get("RCODER_IMAGE_BASE") or MADE_BASE,
        help=f"the base image (default: $RCODER_IMAGE_BASE, else {MADE_BASE}, made from Debian's packages)",
    )
    args = parser.parse_args(argv)
    try:
        built = build(args.base)
        ensure_compose_network()
        print(built)
    except ImageError as exc:
        print(f"image: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
