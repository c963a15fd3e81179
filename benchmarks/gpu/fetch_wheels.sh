#!/usr/bin/env bash
# Downloads, into .whl/ (git-ignored), the wheels a GPU machine without network lacks for the
# GPU scripts (benchmarks/gpu/env.sh installs them there): fla-core (KDA kernels),
# google-crc32c, and the HTTP stack of the e2e parts (pydantic 2 and its pieces, fastapi, which
# imports opentelemetry-api, starlette, uvicorn). Python 3.12 wheels, x86_64.
set -euo pipefail
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d .whl fla-core==0.6.0 google-crc32c==1.9.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-extensions==4.16.0 typing-inspection==0.4.5 fastapi==0.165.0 annotated-doc==0.0.7 \
  opentelemetry-api==1.45.2 starlette==1.10.0 uvicorn==0.54.0
ls .whl
