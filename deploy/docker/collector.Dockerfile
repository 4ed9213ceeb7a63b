# Container image of the rankscope collector (and the `rankscope` CLI), from the repo root:
#   docker build -f deploy/docker/collector.Dockerfile -t rankscope-collector:0.1.0 .
# Debian bookworm packages only, as the project's build (DESIGN.md "Build").
FROM debian:bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      build-essential cmake pkg-config ca-certificates \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev \
      prometheus-cpp-dev libsqlite3-dev libssl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B /build -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DRANKSCOPE_BUILD_TESTS=OFF -DRANKSCOPE_BUILD_BENCHMARKS=OFF -DRANKSCOPE_BUILD_PYTHON=OFF \
 && cmake --build /build -j"$(nproc)" --target rankscope-collector rankscope

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libabsl20220623 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libsqlite3-0 \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o 65532 -g 65532 -m 0750 /var/lib/rankscope
COPY --from=build /build/bin/rankscope-collector /build/bin/rankscope /usr/local/bin/
USER 65532:65532
VOLUME /var/lib/rankscope
EXPOSE 50051 9464
ENTRYPOINT ["/usr/local/bin/rankscope-collector"]
CMD ["--grpc_address=0.0.0.0:50051", "--metrics_address=0.0.0.0:9464", "--db_path=/var/lib/rankscope/rankscope.db"]
