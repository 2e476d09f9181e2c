#!/usr/bin/env bash
# Issue 38's CUDA checks (build item 4) in one run, for a session that is lent a GPU: the CUDA tests, the fake-quant
# kernels against the device's copy bandwidth, the host syncs per steady QAT step, and the QAT step over FP32 (bare
# loop and Lightning fit). Each part has its own time limit, so one that hangs or fails leaves the others' results;
# the limits add up to 530 s, inside one device call of 10 minutes (device tool: timeout_s 590).
#
#   bash bench/cuda_round.sh              # on the GPU machine, in the repository root; logs under $OUT (or /tmp/cuda_round)
#   DEVICE=cpu QUICK=1 bash bench/cuda_round.sh   # the same parts on the CPU, shortened: checks the script itself
#
# The device machine has PyTorch, Lightning and pytest but no Hydra and no network: nothing here imports Hydra, and
# nothing is installed. versions.log names the Python, torch, CUDA and the device the parts ran on.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-${TMPDIR:-/tmp}/cuda_round}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"

if [ "$DEVICE" = cuda ]; then accelerator=gpu; else accelerator=cpu; fi
if [ "$QUICK" = 1 ]; then
    widths=256 rounds=1 steps=24 skip=3 size=512 repeats=1 backend=eager  # no compiles on 2 CPU cores
else
    widths=1024,4096 rounds=3 steps=80 skip=5 size=4096 repeats=7 backend=auto
fi

status=0
# part NAME SECONDS COMMAND...: run COMMAND under a time limit, its output on the terminal and in $OUT/NAME.log
part() {
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s): $*" | tee "$OUT/$name.log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc" | tee -a "$OUT/$name.log"
    [ "$rc" = 0 ] || status=1
}

part versions 20 "$PY" -c "
import platform, torch
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)
print('device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')
import lightning; print('lightning', lightning.__version__)
"

# the tests that run only on a CUDA device (skipped on the CPU: every format forward and backward, eager and through
# triton; a model moved to the GPU; graph-mode PTQ there; the late flags' copies), and the host-sync tests
part tests 150 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" \
    tests/quark/quantization/formats/test_compile_backend.py::test_every_format_runs_on_cuda \
    tests/quark/quantization/test_api.py::test_to_cuda_runs \
    tests/quark/test_graph_mode.py::test_graph_mode_ptq_runs_on_cuda \
    tests/quark/quantization/test_host_syncs.py tests/callbacks/test_quant_host_syncs.py

# host syncs per steady step of every contender (0 expected with the observers off and for TQT); needs CUDA
if [ "$DEVICE" = cuda ]; then
    part syncs 50 "$PY" bench/qat_overhead.py --model cnn --device cuda --check-syncs
fi

# every format's forward (and forward + backward) over a copy of the same tensor, on the device
part fake_quant 100 "$PY" bench/fake_quant.py --device "$DEVICE" --size "$size" --repeats "$repeats" --backend "$backend"

# QAT step over FP32 in a bare loop, with the floor (one pass per weight each way) and torch.ao in the same rounds
part qat_overhead 90 "$PY" bench/qat_overhead.py --model mlp --device "$DEVICE" --widths "$widths" --quick --no-memory

# the issue's protocol: Trainer.fit, observers on for half the steps, each step's span synchronised
part qat_lightning 120 "$PY" bench/qat_lightning.py --accelerator "$accelerator" --widths "$widths" \
    --rounds "$rounds" --steps "$steps" --skip "$skip" --no-peers

echo "logs: $OUT"
exit $status
