# Ballast in a container: one static-asset-embedded binary, run as a
# non-root user, data (the SQLite file, if used) in /var/lib/ballast.
#
#   docker build -t ballast .
#   docker run -p 8080:8080 -v ballast-data:/var/lib/ballast \
#     -e BALLAST_SERVER_PUBLIC_URL=https://ballast.example.com ballast
#
# Put a TLS-terminating proxy in front (cookies are Secure), and list it in
# BALLAST_SERVER_TRUSTED_PROXIES so login limits see real client addresses.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# Dependencies first, so that code changes do not rebuild them.
COPY Cargo.toml Cargo.lock build.rs* ./
# sqlx-core with TCP_NODELAY, patched in by Cargo.toml.
COPY vendor vendor
RUN mkdir src benches && echo 'fn main() {}' > src/main.rs && echo '' > src/lib.rs \
    && echo 'fn main() {}' > benches/engine.rs \
    && cargo build --release --locked || true
COPY src src
COPY templates templates
COPY static static
COPY migrations migrations
COPY benches benches
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin ballast \
    && strip target/release/ballast

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --home-dir /var/lib/ballast --create-home --uid 10001 ballast
# The binary only: shell completions and manual pages come from it on
# demand (`ballast completions bash`, `ballast man`); nobody logs into
# the image for a shell's completions, and it has no `man`.
COPY --from=build /src/target/release/ballast /usr/local/bin/ballast
USER ballast
WORKDIR /var/lib/ballast
ENV BALLAST_SERVER_BIND=0.0.0.0:8080 \
    BALLAST_DATABASE_URL=sqlite:///var/lib/ballast/ballast.db?mode=rwc
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/ballast"]
CMD ["serve"]
