#!/usr/bin/env bash
# Build the container image exactly as docs/deploy.md says, run it as its non-root user, and prove it
# serves: /readyz 200, one chat answer with the key the container printed, the HEALTHCHECK passing.
# .ci/run runs it on every submission (CI=true); run it yourself from the repository root as root.
#
# No registry is reachable here, so the Debian 12 base image is made locally with debootstrap from
# Debian's own mirror (cached as a tarball under $LLAMAGATE_CI_CACHE, keyed by the suite) and imported
# as localhost/debian:12-debootstrap; the build then runs with --pull=never.
#
# Podman settings this job passes in its own containers.conf (CONTAINERS_CONF), not the system's; all
# seen on this machine kind (podman 4.3.1, Debian 12), where the job runs as root without
# CAP_SYS_RESOURCE and with cgroups in hybrid mode:
#   default_ulimits          podman gives root's containers RLIMIT_NOFILE/RLIMIT_NPROC above this sandbox's
#                            hard limits and raising them is refused ("setrlimit `RLIMIT_NPROC`: Operation
#                            not permitted"): explicit values below the hard limits (nofile 16384, nproc
#                            4096) start.
#   runtime = "runc"         crun then fails on the cgroup layout ("cgroups in hybrid mode not supported");
#                            runc (Debian's package) starts the container.
#   cgroup_manager = "cgroupfs", events_logger = "file": no systemd as PID 1 here.
set -euo pipefail
cd "$(dirname "$0")/../.."

IMAGE=${IMAGE:-llamagate:ci}
BASE=localhost/debian:12-debootstrap
NAME=llamagate-ci-$$
PORT=${PORT:-18080}
CACHE=${LLAMAGATE_CI_CACHE:-$HOME/.cache/llamagate-ci}
WORK=$(mktemp -d)
mkdir -p "$CACHE"

cleanup() {
    podman rm -f -t 5 "$NAME" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

nofile=16384
hard=$(ulimit -Hn)
[ "$hard" != unlimited ] && [ "$hard" -lt "$nofile" ] && nofile=$hard
cat >"$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=${nofile}:${nofile}", "nproc=4096:4096"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
export CONTAINERS_CONF="$WORK/containers.conf"

say() { printf 'image-test: %s\n' "$*"; }

# 1. The base image: Debian 12 (bookworm) from Debian's mirror, minimal.
if ! podman image exists "$BASE"; then
    tarball="$CACHE/debian-bookworm-minbase.tar"
    if [ ! -s "$tarball" ]; then
        say "debootstrap bookworm (a few minutes, once per machine)"
        rootfs="$WORK/rootfs"
        debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
            || { tail -20 "$WORK/debootstrap.log"; exit 1; }
        tar -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    fi
    podman import --change 'CMD ["/bin/bash"]' "$tarball" "$BASE" >/dev/null
fi

# 2. The build, as docs/deploy.md shows it (Container, "No registry").
start=$(date +%s)
say "podman build (compiles llama-server inside; about 10 minutes on 2 cores)"
# The build reaches PyPI over TLS. On machines whose traffic to PyPI passes an intercepting proxy (these CI
# machines: "self-signed certificate in certificate chain" inside the container), the base image does not
# trust that proxy's CA: lend the build the host's CA bundle and a pip.conf naming it, for the RUN steps
# only (bind mounts are not part of the image).
mounts=()
if [ -s /etc/ssl/certs/ca-certificates.crt ]; then
    printf '[global]\ncert = /run/host-ca/ca-certificates.crt\n' >"$WORK/pip.conf"
    mounts=(-v /etc/ssl/certs/ca-certificates.crt:/run/host-ca/ca-certificates.crt:ro -v "$WORK/pip.conf:/etc/pip.conf:ro")
fi
podman build --format docker --pull=never "${mounts[@]}" --build-arg DEBIAN="$BASE" --build-arg BAKE_DEMO_MODEL=1 \
    -f deploy/container/Containerfile --ignorefile deploy/container/Containerfile.dockerignore \
    -t "$IMAGE" . >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
built=$(( $(date +%s) - start ))
size=$(podman image inspect "$IMAGE" --format '{{.Size}}')
say "built in ${built} s, $(( size / 1000000 )) MB"
# An OCI image has no HEALTHCHECK: podman shows null there when --format docker was dropped.
healthcheck=$(podman image inspect "$IMAGE" --format '{{json .HealthCheck}}')
case "$healthcheck" in
    *'"Test"'*) ;;
    *) say "the image lost its HEALTHCHECK (was --format docker dropped?): $healthcheck"; exit 1 ;;
esac

# 3. Run it as the image says (its own user), published on loopback only.
podman run -d --name "$NAME" -p "127.0.0.1:${PORT}:8080" --read-only --tmpfs /tmp "$IMAGE" >/dev/null
uid=$(podman exec "$NAME" id -u)
[ "$uid" = 10001 ] || { say "runs as uid $uid, expected 10001"; exit 1; }

deadline=$(( $(date +%s) + 300 ))
until [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:${PORT}/readyz")" = 200 ]; do
    if [ "$(date +%s)" -gt "$deadline" ] || [ "$(podman inspect "$NAME" --format '{{.State.Running}}')" != true ]; then
        say "not ready:"; podman logs "$NAME" 2>&1 | tail -30; exit 1
    fi
    sleep 1
done
say "ready after $(( $(date +%s) - deadline + 300 )) s"

# 4. One chat request with the key the daemon printed at start (stdout, once).
key=$(podman logs "$NAME" 2>/dev/null | grep -oE 'lg_[0-9a-f]{12}_[A-Za-z0-9_-]+' | head -1 || true)
[ -n "$key" ] || { say "no key in the container's output"; podman logs "$NAME" 2>&1 | tail -20; exit 1; }
answer=$(curl -sf "http://127.0.0.1:${PORT}/v1/chat/completions" -H "Authorization: Bearer $key" \
    -H 'Content-Type: application/json' \
    -d '{"model": "smollm2-135m-instruct", "max_tokens": 16, "messages": [{"role": "user", "content": "Hello"}]}')
printf '%s' "$answer" | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["choices"][0]["message"]["content"].strip(), r' \
    || { say "no answer: $answer"; exit 1; }
say "chat answered"

# 5. The image's own HEALTHCHECK.
podman healthcheck run "$NAME" || { say "healthcheck failed"; exit 1; }
say "healthcheck passed"
say "ok: image $IMAGE built in ${built} s, $(( size / 1000000 )) MB, ran as uid 10001, answered, healthy"
