#!/usr/bin/env bash
# The vLLM-facing tests on any list of vLLM releases, each in its own venv, one at a time:
#
#   .ci/vllm_matrix.sh 0.23.0 0.26.0 0.28.0 0.31.0 0.33.0     # every Dynamo pin
#   .ci/vllm_matrix.sh --keep 0.23.0                         # keep the venv for another run
#
# Per release: a venv with that vLLM, the Dynamo runtime (RadixTree) and kvbm (PdConnector) of
# the Dynamo release that pins it, NIXL, and flexkv-py's wheel built once from this checkout
# (the tests import the installed wheel, not the checkout); then the vLLM-facing tests
# ($VLLM_TESTS), and the cross-release restart check: the same prompt stored by this release,
# with and without PYTHONHASHSEED, and loaded from what every earlier release of this run
# stored in the same SSD directory layout (never made-up keys: the hits are what the store
# returns). A venv is 8-9 GB: it is deleted after its run unless --keep; pip's cache is reused.
#
# Prints one JSON line per release (also appended to $VLLM_MATRIX_RESULTS) and exits non-zero
# if any release's tests failed.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${VLLM_MATRIX_DIR:-/tmp/flexkv-vllm-matrix}
RESULTS=${VLLM_MATRIX_RESULTS:-$WORK/results.jsonl}
KEEP=0
if [[ ${1:-} == --keep ]]; then
    KEEP=1
    shift
fi
(($# > 0)) || { echo "usage: $0 [--keep] VLLM_VERSION..." >&2; exit 2; }

# The vLLM-facing tests (connector, drop-in, P/D, events, restart, versions, hybrid where the
# release supports it: the rest skip there with the reason, the support table's ✗ cells). Paths
# are relative to tests/; a bare file name is one of tests/integration/vllm/. Not that whole
# directory (`-m vllm`): its load, slow-device and shutdown tests run on the pinned vLLM only.
VLLM_TESTS=${VLLM_TESTS:-"test_vllm_versions.py test_vllm_connector.py test_vllm_dropin.py test_vllm_pd.py test_vllm_kv_events.py test_vllm_identity.py test_vllm_streaming.py test_vllm_flush_timeout.py test_vllm_gpu_read_done.py test_vllm_pipeline_parallel.py test_vllm_block_sizes.py test_vllm_hybrid.py test_vllm_ssm.py test_vllm_qwen3next.py test_vllm_node_engines.py test_restart_announce.py test_restart_first_hit.py"}

# Dynamo release that pins each vLLM -> its ai-dynamo-runtime, kvbm and kvbm's NIXL.
pins() {
    case $1 in
        0.19.*) echo "1.1.1 1.1.1 0.10.1" ;;
        0.23.*) echo "1.3.1 1.3.1 1.0.1" ;;
        0.26.*) echo "1.4.2 1.4.2 1.0.1" ;;
        0.28.*) echo "1.5.1 1.5.1 1.3.2" ;;
        0.31.*) echo "1.6.1 1.6.1 1.3.2" ;;
        *) echo "1.6.1 1.6.1 1.5.1" ;;  # 0.33+: vLLM's NixlConnector needs NIXL >= 1.5
    esac
}

mkdir -p "$WORK"
echo "== building flexkv-py's wheel from $ROOT" >&2
rm -rf "$WORK/wheel"
python3 -m maturin build --release --quiet -o "$WORK/wheel" >&2
WHEEL=$(ls "$WORK"/wheel/flexkv_py-*.whl)
VLLM_TEST_PATHS=()
for t in $VLLM_TESTS; do
    [[ $t == */* ]] || t=integration/vllm/$t
    VLLM_TEST_PATHS+=("$t")
done
COMMIT=$(git rev-parse --short HEAD)$([[ -z $(git status --porcelain -- flexkv_py rust tests) ]] || echo +dirty)

# One model directory for every release: the cache keys a local model by its files' identity.
MODEL=$WORK/model
mkdir -p "$MODEL"
python3 - "$MODEL" <<'PY'
import json, sys, pathlib
sys.path.insert(0, "tests")
from helpers.vllm_harness import TINY_CONFIG  # noqa: E402
p = pathlib.Path(sys.argv[1]) / "config.json"
if not p.exists():
    p.write_text(json.dumps(TINY_CONFIG))
PY
XVER=$WORK/cross-release
mkdir -p "$XVER"
chmod 700 "$WORK" "$XVER"  # cached KV reveals prompts: the cache directories are private

failed=0
for v in "$@"; do
    read -r dynamo kvbm nixl <<<"$(pins "$v")"
    venv=$WORK/venv-$v
    py=$venv/bin/python
    began=$SECONDS
    echo "== vLLM $v: venv (Dynamo runtime $dynamo, kvbm $kvbm, NIXL $nixl)" >&2
    [[ -x $py ]] || python3 -m venv "$venv"
    "$py" -m pip install -q "vllm==$v" pytest hypothesis "ai-dynamo-runtime==$dynamo" >&2
    # kvbm pins a NIXL that the newest vLLM refuses: kvbm without deps, NIXL named here.
    "$py" -m pip install -q --no-deps "kvbm==$kvbm" >&2
    "$py" -m pip install -q "nixl[cu13]==$nixl" pydantic >&2
    "$py" -m pip install -q --no-deps --force-reinstall "$WHEEL" >&2
    install_s=$((SECONDS - began))

    echo "== vLLM $v: tests" >&2
    began=$SECONDS
    log=$WORK/pytest-$v.log
    rc=0
    # From tests/: the venv's flexkv-py (the wheel) is imported, not the checkout's (tests/ is on
    # sys.path for `helpers`, the repository root is not). pytest still finds the repository's
    # pyproject.toml (rootdir: markers, --strict-markers) and tests/conftest.py.
    (cd tests && VLLM_TARGET_DEVICE=cpu "$py" -m pytest -q -p no:cacheprovider -rs \
        -o faulthandler_timeout=600 "${VLLM_TEST_PATHS[@]}") >"$log" 2>&1 || rc=$?
    test_s=$((SECONDS - began))
    summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed)' "$log" | tail -1 | tr -d '=' | xargs)
    tail -3 "$log" >&2
    ((rc == 0)) || failed=1

    echo "== vLLM $v: cross-release restart" >&2
    cross="{"
    sep=""
    for seed in none 1234; do
        env_seed=()
        [[ $seed == none ]] || env_seed=(PYTHONHASHSEED=$seed)
        store=$XVER/$v-$seed
        rm -rf "$store"
        (cd tests && env -u PYTHONHASHSEED "${env_seed[@]}" VLLM_TARGET_DEVICE=cpu \
            "$py" -m helpers.writers.vllm_restart_child "$MODEL" "$store" store >/dev/null 2>>"$log") || failed=1
        for earlier in "$XVER"/*-"$seed"; do
            [[ -d $earlier && $earlier != "$store" ]] || continue
            from=$(basename "$earlier")
            hits=$( (cd tests && env -u PYTHONHASHSEED "${env_seed[@]}" VLLM_TARGET_DEVICE=cpu \
                "$py" -m helpers.writers.vllm_restart_child "$MODEL" "$earlier" load 2>>"$log") | tail -1 |
                python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["hit_blocks"] if not d["mismatches"] else -1)') ||
                hits=error
            cross+="$sep\"${from%-*}->$v seed=$seed\": \"$hits\""
            sep=", "
        done
    done
    cross+="}"
    line=$(printf '{"vllm": "%s", "commit": "%s", "date": "%s", "dynamo_runtime": "%s", "kvbm": "%s", "nixl": "%s", "install_s": %d, "test_s": %d, "pytest": "%s", "rc": %d, "cross_release_hit_blocks": %s}' \
        "$v" "$COMMIT" "$(date -u +%F)" "$dynamo" "$kvbm" "$nixl" "$install_s" "$test_s" "$summary" "$rc" "$cross")
    echo "$line"
    echo "$line" >>"$RESULTS"
    if ((KEEP == 0)); then
        rm -rf "$venv"
    fi
done
exit $failed
