#!/usr/bin/env bash
# CI: the release wheel installs and runs in a runtime image that has no compiler.
#  1. build ONE abi3 wheel with zig against glibc 2.28 (a plain `maturin build` links against this
#     machine's glibc and gets tagged manylinux_2_34, which pip refuses on older distributions);
#  2. check it with auditwheel and check its contents and entry points;
#  3. install it into a fresh venv that sees the "image's" torch/vLLM and prove that pip installed
#     flexkv-py alone (it must not pull a second torch or vLLM);
#  4. without any Rust toolchain on PATH and outside the checkout: import it, run the main job, and
#     resolve vLLM's FlexKVConnectorV1 name through the plugin, all from the venv's copy.
# Run from anywhere; needs the test extra installed (maturin, ziglang, auditwheel).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd -P)
START=$SECONDS

TMP=$(mktemp -d "${TMPDIR:-/tmp}/flexkv-wheel-check.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
step() { printf '\n=== wheel_check: %s\n' "$*"; }
fail() { printf 'wheel_check: FAIL: %s\n' "$*" >&2; exit 1; }

# --- 1. release wheel ---------------------------------------------------------------------------
# The flags are here, not in [tool.maturin]: `pip install -e .` must keep building with the host
# toolchain (no zig), and compatibility=manylinux_2_28 there would make it audit a host-linked .so.
# Own target dir: zig's linker/CC would otherwise invalidate the shared target/ of dev builds.
step "build (maturin --release --zig --compatibility manylinux_2_28)"
CARGO_TARGET_DIR="$REPO/target/wheel-zig" \
    python3 -m maturin build --release --locked --zig --compatibility manylinux_2_28 \
    --out "$TMP/dist"
shopt -s nullglob
wheels=("$TMP"/dist/*.whl)
shopt -u nullglob
[[ ${#wheels[@]} -eq 1 ]] || fail "expected exactly one wheel, got ${#wheels[@]}: ${wheels[*]-}"
WHEEL=${wheels[0]}
WHEEL_NAME=$(basename "$WHEEL")
# One abi3 wheel for every CPython >= 3.10, installable on glibc >= 2.28.
[[ $WHEEL_NAME == flexkv_py-*-cp310-abi3-manylinux_2_28_x86_64.whl ]] ||
    fail "wheel tag is not cp310-abi3-manylinux_2_28_x86_64: $WHEEL_NAME"
WHEEL_SIZE=$(du -h "$WHEEL" | cut -f1)
echo "wheel: $WHEEL_NAME ($WHEEL_SIZE)"

# --- 2. auditwheel + contents -------------------------------------------------------------------
step "auditwheel show"
AUDIT=$(python3 -m auditwheel show "$WHEEL" 2>&1) || { echo "$AUDIT"; fail "auditwheel show failed"; }
echo "$AUDIT"
# auditwheel wraps its sentences; it names the most compatible tag the wheel's symbols allow.
# Any manylinux_2_N with N <= 28 is fine (a 2_17-consistent wheel also runs on 2_28 systems).
AUDIT_TAG=$(tr -s ' \n' '  ' <<<"$AUDIT" |
    sed -nE 's/.*consistent with the following platform tag: "([^"]+)".*/\1/p')
python3 - "$AUDIT_TAG" <<'EOF' || fail "auditwheel: not consistent with manylinux_2_28 (tag: '$AUDIT_TAG')"
import re, sys
tag = sys.argv[1]
legacy = {"manylinux1_x86_64": 5, "manylinux2010_x86_64": 12, "manylinux2014_x86_64": 17}
m = re.fullmatch(r"manylinux_2_(\d+)_x86_64", tag)
minor = int(m.group(1)) if m else legacy.get(tag)
sys.exit(0 if minor is not None and minor <= 28 else 1)
EOF
echo "auditwheel: consistent with $AUDIT_TAG (<= manylinux_2_28): ok"

step "wheel contents"
python3 - "$WHEEL" <<'EOF' || fail "wheel contents"
import configparser, sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
for n in names:
    print("  " + n)
z = zipfile.ZipFile(sys.argv[1])
need = ["flexkv_py/_native.abi3.so", "flexkv/integration/vllm/vllm_v1_adapter.py",
        "flexkv_py/py.typed"]
missing = [n for n in need if n not in names]
dups = sorted({n for n in names if names.count(n) > 1})
ep_files = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
errors = [f"missing {n}" for n in missing] + [f"duplicate entry {n}" for n in dups]
if len(ep_files) != 1:
    errors.append(f"expected one entry_points.txt, got {ep_files}")
else:
    eps = configparser.ConfigParser(delimiters=("=",))
    eps.optionxform = str  # entry point names are case-sensitive
    eps.read_string(z.read(ep_files[0]).decode())
    want = {("vllm.general_plugins", "flexkv_py"): "flexkv_py.integration.vllm.plugin:register",
            ("console_scripts", "flexkv-py"): "flexkv_py.cli.main:main"}
    for (group, name), value in want.items():
        got = eps.get(group, name, fallback=None)
        if got != value:
            errors.append(f"entry point [{group}] {name}: want {value!r}, got {got!r}")
for e in errors:
    print("wheel_check: " + e, file=sys.stderr)
sys.exit(1 if errors else 0)
EOF
echo "contents: native module, compat adapter, py.typed, plugin + console script entry points: ok"

# --- 3. install into an "image" that already has torch and vLLM ---------------------------------
# --system-site-packages stands in for a runtime image with torch/vLLM preinstalled.
# --without-pip: the venv's python runs the image's pip; a venv's own bundled pip/setuptools
# (setuptools 65 on 3.11) would hide the image's newer setuptools, which torch requires.
# --no-index: every dependency must already be there, so a missing one fails here at once
# instead of downloading a second torch; the report then proves pip installed flexkv-py alone.
step "install into a fresh venv (--system-site-packages)"
VENV=$TMP/venv
python3 -m venv --system-site-packages --without-pip "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-input --no-index \
    --report "$TMP/report.json" "$WHEEL" ||
    fail "pip install failed (a dependency the image lacks? --no-index fetches nothing)"
"$VENV/bin/python" - "$TMP/report.json" <<'EOF' || fail "pip installed more than flexkv-py"
import json, sys
report = json.load(open(sys.argv[1]))
installed = [(i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"]]
print("pip report, installed:", ", ".join(f"{n}=={v}" for n, v in installed))
sys.exit(0 if [n.lower().replace("_", "-") for n, _ in installed] == ["flexkv-py"] else 1)
EOF
echo "pip report: flexkv-py only, every dependency already satisfied: ok"

# --- 4. run it with no Rust toolchain, outside the checkout -------------------------------------
# A clean environment: no cargo/rustc, no CARGO_*/RUSTUP_*/PYTHONPATH/VIRTUAL_ENV from the caller;
# cwd is the temp dir, so neither '' on sys.path nor the editable install's path shadows the venv.
norust() {
    (cd "$TMP" && env -i HOME="${HOME:-$TMP}" LANG=C.UTF-8 TMPDIR="$TMP" \
        PATH="$VENV/bin:/usr/local/bin:/usr/bin:/bin" "$@")
}
step "no Rust toolchain on PATH"
norust bash -c '! command -v cargo && ! command -v rustc' ||
    fail "cargo or rustc is still on PATH (printed above)"
[[ $(norust bash -c 'command -v flexkv-py') == "$VENV/bin/flexkv-py" ]] ||
    fail "flexkv-py on PATH is not the venv's"
echo "cargo, rustc: not found; flexkv-py: $VENV/bin/flexkv-py: ok"

step "(a) imports come from the venv"
norust python - "$REPO" <<'EOF' || fail "(a) flexkv-py is not imported from the venv"
import importlib.metadata as md, json, os, sys, sysconfig
import flexkv, flexkv_py, flexkv_py._native
repo, site = sys.argv[1], os.path.realpath(sysconfig.get_paths()["purelib"])
inside = lambda p: os.path.realpath(p).startswith(site + os.sep)
errors = []
for mod in (flexkv_py, flexkv_py._native, flexkv):
    print(f"  {mod.__name__}: {mod.__file__}")
    if not inside(mod.__file__) or os.path.realpath(mod.__file__).startswith(repo + os.sep):
        errors.append(f"{mod.__name__} from {mod.__file__}, not {site}")
# importlib.metadata keeps the first distribution of a name on sys.path: the venv's, not the
# system's editable flexkv-py. vLLM finds its plugin that way, so check both views.
dist = md.distribution("flexkv-py")
where = os.path.realpath(dist.locate_file(""))
direct = json.loads(dist.read_text("direct_url.json") or "{}")
print(f"  distribution flexkv-py {dist.version}: {where} (direct_url: {direct.get('url')})")
if where != site or direct.get("dir_info", {}).get("editable"):
    errors.append(f"flexkv-py metadata from {where}, editable={direct.get('dir_info')}")
eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "flexkv_py"]
for ep in eps:
    print(f"  entry point {ep.name} = {ep.value}: {os.path.realpath(ep.dist.locate_file(''))}")
if len(eps) != 1 or os.path.realpath(eps[0].dist.locate_file("")) != site:
    errors.append(f"vllm.general_plugins flexkv_py not resolved once from the venv: {eps}")
for e in errors:
    print("wheel_check: " + e, file=sys.stderr)
sys.exit(1 if errors else 0)
EOF
echo "(a) flexkv_py, its native module, flexkv and the entry points are the venv's: ok"

step "(b) flexkv-py replay --quick --no-progress"
norust flexkv-py replay --quick --no-progress || fail "(b) replay failed (wrong KV or crash)"
echo "(b) replay: ok"

step "(c) vLLM's FlexKVConnectorV1 name through the plugin"
# vLLM logs to stdout, so the resolved class comes back through a file.
norust env VLLM_TARGET_DEVICE=cpu python - "$TMP/connector.txt" <<'EOF' ||
import os, sys, sysconfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.plugins import load_general_plugins
load_general_plugins()
cls = KVConnectorFactory.get_connector_class_by_name("FlexKVConnectorV1")
path = os.path.realpath(sys.modules[cls.__module__].__file__)
site = os.path.realpath(sysconfig.get_paths()["purelib"])
name = f"{cls.__module__}.{cls.__qualname__}"
print(f"  FlexKVConnectorV1 -> {name} from {path}")
open(sys.argv[1], "w").write(name)
ok = cls.__module__ == "flexkv_py.integration.vllm.connector" and path.startswith(site + os.sep)
sys.exit(0 if ok else 1)
EOF
    fail "(c) FlexKVConnectorV1 did not resolve to the venv's flexkv_py connector"
CONNECTOR=$(<"$TMP/connector.txt")
echo "(c) FlexKVConnectorV1 -> $CONNECTOR: ok"

printf '\nwheel_check: OK %s (%s, auditwheel %s): flexkv-py only installed; import, replay and ' \
    "$WHEEL_NAME" "$WHEEL_SIZE" "$AUDIT_TAG"
printf 'FlexKVConnectorV1 -> %s from the venv without Rust, in %ss\n' "$CONNECTOR" \
    "$((SECONDS - START))"
