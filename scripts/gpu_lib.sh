# Shared by scripts/gpu_check.sh and scripts/gpu_copy.sh (sourced from the repository root): the install of the
# carried wheels, and the CUDA tests (the tests whose math depends on the device, at their [cuda] instances).

# the test files with [cuda] instances (the on_each_device fixture) or GPU-only tests
CUDA_TESTS=(tests/attention tests/models/test_short_conv.py tests/experiments/test_copy_task.py
            tests/experiments/test_recall.py)

# install_wheels DIR: DIR/*.whl into /tmp/site, put first on PYTHONPATH with the checkout; refuses, with the fix,
# where DIR holds none
install_wheels() {
  if ! ls "$1"/*.whl >/dev/null 2>&1; then
    echo "error: no wheels in $1/: run 'bash scripts/gpu_check.sh --download' on a machine with a package" \
         "registry first and carry $1/ with the command." >&2
    return 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$1"/*.whl || return 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
}

# run_cuda_tests TIMEOUT_S WORKERS EACH_S LOG [PYTEST ARGS...]: the CUDA tests over WORKERS pytest-xdist processes
# (-v: each result is logged as it comes, so a run stopped by the timeout still names its failures); returns
# pytest's exit status. The timeout stops pytest, not its xdist workers (execnet children): they are stopped here,
# before anything else uses the GPU.
run_cuda_tests() {
  local timeout_s=$1 workers=$2 each_s=$3 log=$4
  shift 4
  timeout "$timeout_s" "${PYTHON:-python3}" -m pytest -v -rf -p no:cacheprovider -p no:benchmark -n "$workers" \
    --timeout "$each_s" -k cuda "${CUDA_TESTS[@]}" "$@" > "$log" 2>&1
  local rc=$?
  pkill -9 -f "sys.stdin.readline" 2>/dev/null
  return $rc
}
