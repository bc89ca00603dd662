"""transfer_bench's summary: the headline engine per direction against the memcpy ceiling and
one copy_ per page, every engine's ratio per layout, and the pool pinning times."""

from __future__ import annotations

from typing import Any

import torch


def summary(layouts: list[dict[str, Any]], pin: list[dict[str, Any]], cuda: bool) -> dict[str, Any]:
    main = layouts[0]
    good = [e for e in main["engines"] if "error" not in e and e["bit_exact"]]
    auto = [e for e in good if e["backend"] == "auto"]
    best_d2h = auto[0] if auto else (max(good, key=lambda e: e["d2h_gbps"]) if good else None)
    best_h2d = auto[0] if auto else (max(good, key=lambda e: e["h2d_gbps"]) if good else None)
    ceil = main["ceiling"]
    base = main["per_page"]

    def name(e: dict[str, Any] | None) -> str | None:
        if e is None:
            return None
        if e["backend"] == "triton":
            return (
                f"triton(p={e['triton_programs']},tile={e['triton_tile_bytes']},"
                f"w={e['triton_warps']})"
            )
        if e["backend"] == "staged":
            hint = "" if e.get("copy_engine_prefer_overlap", True) else ",no-hint"
            return f"staged(chunk={e.get('staged_chunk_pages', 32)}{hint})"
        if e["backend"] == "copy_engine" and not e.get("copy_engine_prefer_overlap", True):
            return "copy_engine(no-hint)"
        if e["backend"] == "auto":
            return f"auto(d2h={e['d2h_path']},h2d={e['h2d_path']})"
        return str(e["backend"])

    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "layout": main["layout"],
        "blocks": main["blocks"],
        "page_nbytes": main["page_nbytes"],
        "d2h_engine": name(best_d2h),
        "h2d_engine": name(best_h2d),
        "d2h_gbps": best_d2h["d2h_gbps"] if best_d2h else None,
        "h2d_gbps": best_h2d["h2d_gbps"] if best_h2d else None,
        "ceiling_d2h_gbps": ceil["d2h_gbps"],
        "ceiling_h2d_gbps": ceil["h2d_gbps"],
        "per_page_d2h_gbps": base["d2h_gbps"],
        "per_page_h2d_gbps": base["h2d_gbps"],
        "d2h_sms": best_d2h["sms_used"] if best_d2h else None,
        "h2d_sms": best_h2d["h2d_sms_used"] if best_h2d else None,
    }
    if best_d2h and best_h2d:
        out["d2h_ratio"] = out["d2h_gbps"] / ceil["d2h_gbps"]
        out["h2d_ratio"] = out["h2d_gbps"] / ceil["h2d_gbps"]
        out["d2h_vs_per_page"] = out["d2h_gbps"] / base["d2h_gbps"]
        out["h2d_vs_per_page"] = out["h2d_gbps"] / base["h2d_gbps"]
    for lay in layouts:
        for e in lay["engines"]:
            if "error" in e:
                continue
            key = f"{lay['layout']}/{name(e)}"
            out.setdefault("engines", {})[key] = {
                "d2h_gbps": round(e["d2h_gbps"], 2),
                "h2d_gbps": round(e["h2d_gbps"], 2),
                "d2h_ratio": round(e["d2h_gbps"] / lay["ceiling"]["d2h_gbps"], 3),
                "h2d_ratio": round(e["h2d_gbps"] / lay["ceiling"]["h2d_gbps"], 3),
                "sms": e["sms_used"],
                "bit_exact": e["bit_exact"],
            }
    ok_pins = [p for p in pin if "error" not in p]
    if ok_pins:
        out["pool_pin"] = {p["variant"]: round(p["total_s"], 2) for p in ok_pins}
        out["pool_pin_gib"] = round(ok_pins[0]["gib"], 1)
        out["pool_pin_best_s"] = round(min(p["total_s"] for p in ok_pins), 2)
    return out
