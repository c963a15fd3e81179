# Sourced by the GPU run scripts, from the repository root: installs the wheels
# the GPU machine lacks (from .whl/, when present) into /tmp/site, puts them and
# this checkout on PYTHONPATH, keeps Python's output unbuffered and NVLink
# multicast off.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
