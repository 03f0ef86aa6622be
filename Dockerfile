# mlakv: multi-stage image.
#   build:   CUDA 13.0 devel on Ubuntu 24.04; installs the packages with
#            scripts/install_deps.sh (the same script CI runs) and builds
#            mlakv-server and the mlakv CLI the way scripts/setup.sh does.
#   runtime: the matching CUDA runtime image with the two programs and the
#            shared libraries they load (collected with ldd), run as a non-root
#            user.
# Build:  docker build -t mlakv:dev .
# Run:    docker run --gpus all -p 50051:50051 -p 9090:9090 mlakv:dev --metrics_listen 0.0.0.0:9090
# See docs/deploy.md.

ARG CUDA_VERSION=13.0.1
ARG UBUNTU=ubuntu24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build
# CUDA architectures to compile for (sm_90 = H100/H200; add 100 for B200).
ARG CUDA_ARCHITECTURES=90
WORKDIR /src
COPY scripts/install_deps.sh scripts/install_deps.sh
RUN scripts/install_deps.sh --build && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES}" \
 && ninja -C build mlakv-server mlakv \
 && mkdir -p /opt/mlakv/bin \
 && cp build/server/mlakv-server build/client/mlakv /opt/mlakv/bin/ \
 && scripts/collect_runtime_libs.sh /opt/mlakv/lib /opt/mlakv/bin/mlakv-server /opt/mlakv/bin/mlakv

FROM nvidia/cuda:${CUDA_VERSION}-runtime-${UBUNTU} AS runtime
LABEL org.opencontainers.image.title="mlakv" \
      org.opencontainers.image.description="NVFP4 MLA paged KV-cache service (gRPC)"
COPY --from=build /opt/mlakv /opt/mlakv
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin mlakv
ENV PATH="/opt/mlakv/bin:${PATH}" \
    LD_LIBRARY_PATH="/opt/mlakv/lib:/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
USER 10001:10001
WORKDIR /tmp
# 50051: gRPC (KvCache, grpc.health.v1, reflection). 9090: Prometheus /metrics
# (served only when --metrics_listen is given; the Kubernetes base passes it).
EXPOSE 50051 9090
ENTRYPOINT ["mlakv-server", "--listen", "0.0.0.0:50051"]
