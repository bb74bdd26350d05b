# The serving image: this checkout on Ray's Python 3.11 image, installed as `make install` installs it
# (docs/cluster.md#the-image). `make image` builds it: DEVICE=cpu (the default) or DEVICE=gpu (CUDA torch).
# tests/test_dockerfile.py keeps its install steps equal to the Makefile's and its Ray to requirements.txt's.
ARG DEVICE=cpu
FROM rayproject/ray:2.60.0-py311-${DEVICE}
ARG DEVICE

# llm/model/cpu_kernels.py compiles its C++ kernels the first time a process needs them, with -march=native: the
# image carries a compiler and no prebuilt kernels, since the build machine's CPU need not be the one that serves.
USER root
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# The base image's non-root user (uid 1000): Ray and KubeRay expect its home and its Python.
USER ray
WORKDIR /home/ray/vlm-serve

# `make install`, step by step. torch first and pinned: for the CPU image from PyTorch's CPU index (PyPI's wheel is the
# CUDA build, gigabytes of CUDA packages); for the GPU image that CUDA build from PyPI.
COPY --chown=ray:users requirements.txt requirements-test.txt ./
RUN if [ "$DEVICE" = cpu ]; then set -- --index-url https://download.pytorch.org/whl/cpu; fi && \
    pip install --no-cache-dir "$@" torch==2.13.0
RUN pip install --no-cache-dir -r requirements.txt -r requirements-test.txt

# The code and the committed demo checkpoint (demo/qwen2-vl-shapes, serve_config.yaml's args.model).
COPY --chown=ray:users . .
# Ray's workers start elsewhere and import the app (serve_config.yaml's import_path) from here.
ENV PYTHONPATH=/home/ray/vlm-serve
CMD ["serve", "run", "serve_config.yaml"]
