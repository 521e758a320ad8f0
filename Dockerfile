# The README's install in an image: make setup (FFmpeg, .venv with torch and the dev extra).
#   docker build -t wampipe .                                                                  # CPU torch
#   docker build -t wampipe:cu128 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .   # CUDA torch
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq make ffmpeg \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /wampipe
COPY . .
RUN make setup TORCH_INDEX=$TORCH_INDEX && rm -rf /root/.cache/pip
ENV PATH=/wampipe/.venv/bin:$PATH
CMD ["make", "help"]
