"""Carry what a fresh H200 image lacks for `benchmarks/gpu_check.sh`, in parts that fit the
device tool's 64 MiB per call, and put it back together there.

The lent H200 image has torch, pytest, numpy, rich and cuda-bindings, but not
nvidia-cutlass-dsl (its cu13 library wheel alone is about 92 MB), nvshmem4py, apache-tvm-ffi
or hatchling, and the drops' git-ignored `src/` trees do not travel on their own. `pack`
(here, with PyPI) downloads the wheels at the versions of `uv.lock`, tars them with the
drops' `src/`, and splits the tar into parts; each device call carries one part, which the
warm machine keeps in /tmp; the last call runs `gpu_check.sh` with `MOE_EP_CARRY_PARTS`,
whose step 0 calls `assemble` (there, no network) to check and unpack them.

  python3 benchmarks/gpu_carry.py pack [--out .gpu_carry] [--part-mib 56]
  python3 benchmarks/gpu_carry.py assemble --parts /tmp/moe_ep_parts --wheels DIR
  python3 benchmarks/gpu_carry.py install --wheels DIR

`pack` prints the device calls to make. The machine must stay warm between them (it is
given back after about 30 s idle; then the parts sent so far are lost).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOCKED_WHEELS = (
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu13",  # one toolkit flavor is enough (the cu12 one is not carried)
    "nvshmem4py-cu13",
    "cuda-core",  # nvshmem4py needs cuda.core >= 0.5 and cuda.pathfinder >= 1.2.3: the
    "cuda-pathfinder",  # image has both, of versions not recorded; `install` upgrades only
    "apache-tvm-ffi",
)
"""Runtime packages the image lacks (or may hold too old), at the versions `uv.lock` pins."""

BUILD_WHEELS = {
    "hatchling": "1.33.0",
    "editables": "0.6",
    "trove-classifiers": "2026.9.21.13",
    "tomlkit": "0.15.2",
}
"""What `pip install -e --no-build-isolation` of our packages needs there (hatchling's
other needs, packaging / pathspec / pluggy, are on the image)."""

DROPS = (
    "sm90_pull_cutedsl",
    "sm90_pull_nvfp4",
    "sm90_push_cuda",
    "sm90_push_cuda_deps",
    "sm100_cutedsl_megamoe",
    "sm100_next_cutedsl_megamoe",
)
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")  # fmt: skip
MANIFEST = "manifest.json"
DEVICE_PARTS = "/tmp/moe_ep_parts"


def locked_versions(lock: Path, names: tuple[str, ...]) -> dict[str, str]:
    """`{name: version}` of `names` in `uv.lock`; `SystemExit` naming any it lacks."""
    packages = tomllib.loads(lock.read_text())["package"]
    found = {p["name"]: p["version"] for p in packages if p["name"] in names}
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"gpu_carry: {lock} pins no version of {', '.join(missing)}")
    return found


def _pip() -> list[str]:
    """A pip to download with: this interpreter's, else python3's (uv's venvs have none)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    return ["python3", "-m", "pip"]


def download(pins: dict[str, str], dest: Path, python_version: str) -> list[Path]:
    """Binary wheels of `pins` for CPython `python_version` on x86-64 Linux, into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, (name, version) in enumerate(sorted(pins.items()), 1):
        stem = name.replace("-", "_")
        have = sorted(dest.glob(f"{stem}-{version}-*.whl"))
        if not have:
            print(f"[{i}/{len(pins)}] download {name}=={version}", flush=True)
            cmd = [*_pip(), "download", "-q", "--no-deps",
                   "--only-binary=:all:", "--implementation", "cp",
                   "--python-version", python_version, "-d", str(dest)]  # fmt: skip
            for plat in PLATFORMS:
                cmd += ["--platform", plat]
            subprocess.run([*cmd, f"{name}=={version}"], check=True)
            have = sorted(dest.glob(f"{stem}-{version}-*.whl"))
        if len(have) != 1:
            raise SystemExit(f"gpu_carry: expected one wheel of {name}=={version}, found {have}")
        wheels.append(have[0])
    return wheels


def build_tar(wheels: list[Path], drops: tuple[str, ...], root: Path = ROOT) -> bytes:
    """gzip tar: `wheels/<file>` and `vendor/<drop>/src/...` of `root` (each must exist)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for w in wheels:
            tar.add(w, arcname=f"wheels/{w.name}")
        for drop in drops:
            src = root / "vendor" / drop / "src"
            if not src.is_dir():
                raise SystemExit(f"gpu_carry: {src} is missing: uv run tools/vendor.py sync --all")
            tar.add(src, arcname=f"vendor/{drop}/src")
    return buf.getvalue()


def split(data: bytes, part_bytes: int, out: Path) -> list[Path]:
    """Write `data` as `out/part-NN` files of at most `part_bytes`, plus the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*"):
        old.unlink()
    parts = []
    for i, start in enumerate(range(0, len(data), part_bytes)):
        p = out / f"part-{i:02d}"
        p.write_bytes(data[start : start + part_bytes])
        parts.append(p)
    manifest = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "parts": [p.name for p in parts],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return parts


def assemble(parts_dir: Path, wheels_dir: Path, root: Path) -> list[str]:
    """Check the parts against the manifest, unpack wheels into `wheels_dir` and the drops'
    `src/` under `root`; returns the wheel file names. `SystemExit` on anything missing."""
    manifest = json.loads((parts_dir / MANIFEST).read_text())
    missing = [n for n in manifest["parts"] if not (parts_dir / n).is_file()]
    if missing:
        raise SystemExit(
            f"gpu_carry: parts {missing} of {manifest['parts']} are not in {parts_dir} "
            "(was the machine given back between calls?)"
        )
    data = b"".join((parts_dir / n).read_bytes() for n in manifest["parts"])
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != manifest["bytes"] or digest != manifest["sha256"]:
        raise SystemExit(
            f"gpu_carry: reassembled {len(data)} bytes with sha256 {digest}; the manifest "
            f"says {manifest['bytes']} bytes, {manifest['sha256']}: a part is stale or torn"
        )
    wheels_dir.mkdir(parents=True, exist_ok=True)
    names = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.name.startswith("wheels/") and member.isfile():
                member.name = member.name.removeprefix("wheels/")
                tar.extract(member, wheels_dir, filter="data")
                names.append(member.name)
            elif member.name.startswith("vendor/"):
                tar.extract(member, root, filter="data")
            else:
                raise SystemExit(f"gpu_carry: unexpected member {member.name!r} in the carry")
    return sorted(names)


def _version_key(version: str) -> tuple[int, ...]:
    """Numeric release parts of `version` ("13.4.4" -> (13, 4, 4); "0.1.15.post2" -> (0, 1, 15))."""
    key = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        key.append(int(digits))
    return tuple(key)


def wheels_to_install(wheels_dir: Path, installed: dict[str, str]) -> list[tuple[Path, str]]:
    """(wheel, why) for each carried wheel whose distribution is missing from `installed`
    (`{normalized name: version}`) or older there; a newer or equal one is kept."""
    chosen = []
    for whl in sorted(wheels_dir.glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        have = installed.get(name.lower().replace("-", "_"))
        if have is None:
            chosen.append((whl, f"{name} {version}: not installed"))
        elif _version_key(have) < _version_key(version):
            chosen.append((whl, f"{name} {version}: replaces {have}"))
    return chosen


def install(wheels_dir: Path) -> int:
    """Install the carried wheels python3 lacks or has older, in one `pip --no-deps` call
    (the carried set is what the image lacks: nvidia-cutlass-dsl's metadata also asks for its
    cu12 library wheel, which is not carried, the cu13 one being enough). pip's status."""
    import importlib.metadata as md

    installed = {
        d.metadata["Name"].lower().replace("-", "_"): d.version for d in md.distributions()
    }
    chosen = wheels_to_install(wheels_dir, installed)
    for _, why in chosen:
        print(f"  install {why}", flush=True)
    kept = len(list(wheels_dir.glob("*.whl"))) - len(chosen)
    print(f"  {kept} carried wheels not needed (installed, same or newer)", flush=True)
    if not chosen:
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-cache-dir", *(str(w) for w, _ in chosen)]  # fmt: skip
    return subprocess.run(cmd, check=False).returncode


def _plan(parts: list[Path], out: Path) -> str:
    rel = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    lines = [
        f"{len(parts)} device calls, back to back (the machine goes back after ~30 s idle):",
    ]
    for i, p in enumerate(parts):
        carry = [f"{rel}/{p.name}", f"{rel}/{MANIFEST}"]
        cmd = f"mkdir -p {DEVICE_PARTS} && cp {rel}/part-* {rel}/{MANIFEST} {DEVICE_PARTS}/"
        if i == len(parts) - 1:
            cmd += f" && MOE_EP_CARRY_PARTS={DEVICE_PARTS} bash benchmarks/gpu_check.sh"
        else:
            cmd += f" && ls -l {DEVICE_PARTS}"
        lines.append(f"  call {i + 1}: carry={json.dumps(carry)} command={cmd!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    pk = sub.add_parser("pack", help="download, tar and split (here, with PyPI)")
    pk.add_argument("--out", type=Path, default=ROOT / ".gpu_carry",
                    help="folder for the wheels, parts and manifest (.gpu_carry)")  # fmt: skip
    pk.add_argument("--part-mib", type=int, default=56,
                    help="part size; the tracked files (~2 MiB) travel with each part")  # fmt: skip
    pk.add_argument("--python-version", default="3.12", help="the image's python3 (3.12)")
    pk.add_argument("--no-sm100", action="store_true", help="leave the sm100 drop out")
    asm = sub.add_parser("assemble", help="check and unpack the parts (on the GPU machine)")
    asm.add_argument("--parts", type=Path, required=True,
                     help="folder holding part-NN and manifest.json")  # fmt: skip
    asm.add_argument("--wheels", type=Path, required=True, help="folder to unpack the wheels to")
    ins = sub.add_parser("install", help="pip-install the carried wheels python3 lacks")
    ins.add_argument("--wheels", type=Path, required=True, help="folder of the carried wheels")
    args = ap.parse_args(argv)
    if args.verb == "install":
        return install(args.wheels)
    if args.verb == "assemble":
        names = assemble(args.parts, args.wheels, ROOT)
        print(f"gpu_carry: {len(names)} wheels in {args.wheels}; drops' src/ under {ROOT}")
        return 0
    if args.part_mib < 1 or args.part_mib > 62:
        ap.error(f"--part-mib must be in 1..62 (the device tool carries 64 MiB per call), "
                 f"got {args.part_mib}")  # fmt: skip
    pins = locked_versions(ROOT / "uv.lock", LOCKED_WHEELS) | BUILD_WHEELS
    wheels = download(pins, args.out / "wheels", args.python_version)
    drops = tuple(d for d in DROPS if not d.startswith("sm100_")) if args.no_sm100 else DROPS
    print(f"tar + gzip {len(wheels)} wheels and {len(drops)} drops' src/ ...", flush=True)
    data = build_tar(wheels, drops)
    parts = split(data, args.part_mib << 20, args.out)
    sizes = ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in parts)
    print(f"{len(data) / 2**20:.1f} MiB in {len(parts)} parts: {sizes}")
    print(_plan(parts, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
