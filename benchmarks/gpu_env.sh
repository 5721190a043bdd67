# Sourced by the gpu_*.sh scripts: the peers carried in .whl/ and fusepass
# itself, installed on a fresh GPU machine.  Wheels go to /tmp/site (on
# PYTHONPATH); flash-linear-attention to /tmp/site-fla, which only the per-op
# benchmark puts on its path (installed, it is what transformers runs for
# Gated DeltaNet, and the tests and end-to-end rows check fusepass on
# transformers' own path); gemlite is a source tree (.whl/gemlite_src/gemlite).
export PYTHONUNBUFFERED=1 FUSEPASS_COMMIT=${FUSEPASS_COMMIT:-unknown}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $(ls .whl/*.whl | grep -v fla_core) \
    && export PYTHONPATH=/tmp/site
  ls .whl/fla_core*.whl >/dev/null 2>&1 \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla .whl/fla_core*.whl
fi
[ -d .whl/gemlite_src ] && export PYTHONPATH=${PYTHONPATH:-}:$PWD/.whl/gemlite_src
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
