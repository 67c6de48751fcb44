# A stand-in for the official prom/prometheus image, for machines with no container registry
# (see .ci/setup-extras.sh): Debian's prometheus package on the local Debian base, laid out
# like the official image (binary on /bin/prometheus, data in /prometheus, runs as nobody).
# Where a registry is reachable, compose pulls the real image and this file is not used.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d \
 && test -x /bin/prometheus \
 && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
