# A CUDA image that runs the selftest on the GPU it is started with:
#   docker build -t rope-dispatch . && docker run --gpus all rope-dispatch
# NVIDIA's PyTorch container already holds CUDA PyTorch, Triton and TransformerEngine, so every
# backend is available. Not built in CI (no Docker engine there); kept deliberately simple.
FROM nvcr.io/nvidia/pytorch:25.10-py3

WORKDIR /opt/rope-dispatch
COPY pyproject.toml README.md ./
COPY rope_dispatch ./rope_dispatch
COPY backends ./backends
# --no-deps keeps the container's own torch, triton and transformer-engine builds.
RUN python -m pip install --no-cache-dir "pydantic>=2" "platformdirs>=3" \
 && python -m pip install --no-cache-dir --no-deps .

CMD ["python", "-m", "rope_dispatch.selftest"]
