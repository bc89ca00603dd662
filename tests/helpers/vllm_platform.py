"""vLLM's CPU platform in every test process, on every supported vLLM release.

vLLM before 0.26 picks the CPU platform only for its CPU build, not by VLLM_TARGET_DEVICE: its CPU
probe is pointed at the CPU platform (before anything resolves the platform), so vLLM's CPU paths
(the CPU attention backend's block size and KV shape) are the ones tested on every release.
Importing this module does it, before the importer's own vLLM imports (imported first: plain
`import` lines sort before `from vllm ...` ones).
"""

from __future__ import annotations

import inspect
import os
import sys

# Whether this vLLM needed the probe pointed at the CPU platform (a release before 0.26).
CPU_PLATFORM_FORCED = False


def use_cpu_platform() -> None:
    global CPU_PLATFORM_FORCED
    from vllm import platforms

    probe = getattr(platforms, "cpu_platform_plugin", None)
    plugins = getattr(platforms, "builtin_platform_plugins", None)
    if probe is None or plugins is None or os.environ.get("VLLM_TARGET_DEVICE") != "cpu":
        return
    if "VLLM_TARGET_DEVICE" in inspect.getsource(probe):
        return
    current = getattr(platforms, "_current_platform", None)
    if current is not None and type(current).__name__ != "UnspecifiedPlatform":
        return  # a real platform (a GPU machine): leave it
    plugins["cpu"] = lambda: "vllm.platforms.cpu.CpuPlatform"
    CPU_PLATFORM_FORCED = True
    if current is None:
        return
    # Resolved while `import vllm` ran (0.26): swap it wherever vLLM's modules bound it.
    from vllm.platforms.cpu import CpuPlatform

    cpu = CpuPlatform()
    platforms._current_platform = cpu
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "")
        if name.startswith("vllm") and getattr(module, "current_platform", None) is current:
            module.current_platform = cpu


use_cpu_platform()
