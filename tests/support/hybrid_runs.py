"""What the hybrid-model e2e tests share: telling vLLM's own failures to run a
linear-attention model on its CPU platform from the connector's."""

from __future__ import annotations


def why_vllm_cannot_run(exc: BaseException) -> str | None:
    """vLLM's own refusal or failure to run a linear-attention model with prefix
    caching on its CPU platform, else None. Seen on vLLM 0.23: on AMX hosts it
    turns prefix caching off for linear attention, then refuses --mamba-block-size;
    elsewhere its CPU fused-MoE builds a custom op outside the config context,
    or its CPU Gated DeltaNet kernel rejects the state dtype it picked itself
    ('Input tensor dtype mismatch', on AVX512-BF16 hosts), or it sizes no KV cache
    memory for the model at all ('0.0 GiB KV cache is needed ... (0.0 GiB)')."""
    import traceback

    if "--mamba-block-size can only be set with --enable-prefix-caching" in str(exc):
        return "its CPU platform turns prefix caching off for linear attention"
    if "available KV cache memory (0.0 GiB)" in str(exc):
        return "its CPU platform sizes no KV cache memory for this model"
    frames = traceback.extract_tb(exc.__traceback__)
    first_line = str(exc).split(". ")[0][:60]
    if any(f.filename.endswith("cpu_fused_moe.py") for f in frames):
        return f"its CPU fused MoE fails ({first_line!r})"
    if any("/mamba/ops/cpu/" in f.filename for f in frames):
        return f"its CPU linear-attention kernel fails ({first_line!r})"
    return None
