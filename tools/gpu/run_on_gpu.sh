#!/bin/sh
# On the GPU machine, from the repository root, in the call that carries the last
# part: keep the parts this transfer brought, then install the bundle and run the
# preflight, the e2e accuracy tests and the long-document QA, logs and tables to OUT.
#   tools/gpu/run_on_gpu.sh OUT [arguments for benchmarks/gpu_long_doc_qa.py]
# Earlier calls, one per part: python3 tools/gpu/gpu_run.py receive build/gpu_bundle/parts
set -e
out=${1:?usage: tools/gpu/run_on_gpu.sh OUT [qa arguments]}
shift
python3 tools/gpu/gpu_run.py receive build/gpu_bundle/parts
exec python3 tools/gpu/gpu_run.py run --out "$out" --qa-args "$@"
