#!/usr/bin/env bash
# The test control plane for tests/cluster/k8s: kube-apiserver v1.20.2 and etcd 3.4, built as
# ../shared/k8s-envtest/build.sh builds them (the same Debian packages, the same toolchain, the
# same folder and layout, so its start.sh and stop.sh run either build), with two changes that
# cut the build's CPU (benchmarks/envtest_build_cpu_2026-11-29.md):
#
# - Only the OpenAPI code is generated (`make gen_openapi`). Kubernetes' `make` regenerates
#   every kind of code first: deep copies, defaults, conversions, release lifecycles and
#   bindata. Its source archive carries all of these except the server's OpenAPI
#   definitions, so building their five generators and running them changes nothing.
# - The compiler does not inline (GOGCFLAGS=all=-l, unless the caller sets GOGCFLAGS): 166
#   CPU-s of compiling against 205. The server then costs about 5.5 CPU-s more in the k8s
#   tests.
# Together: 220.7 CPU-s against 288.2 for the shared script. Go's garbage collector runs at
# GOGC=400 here (unless set), as the Makefile ran the shared script: 309-323 CPU-s against
# 385 at Go's default of 100, for that script's build.
#
#   tests/cluster/k8s/build_apiserver.sh   -> binaries in $CONVOY_ENVTEST_DIR/bin
#                                             (default ~/.cache/convoy-envtest)
#
# Idempotent: returns at once when the binaries are there (built by either script). Needs
# root for apt-get, the Debian archive this machine's apt configuration names, and ~2 GB of
# disk while building.
set -euo pipefail
W=${CONVOY_ENVTEST_DIR:-$HOME/.cache/convoy-envtest}
if [ -x "$W/bin/kube-apiserver" ] && [ -x "$W/bin/etcd" ]; then echo "$W/bin"; exit 0; fi
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '/^deb / && !/security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$mirror" ] || { echo "build_apiserver: cannot find the Debian archive in the apt configuration" >&2; exit 3; }
security="${mirror%/debian}/debian-security"
command -v rsync >/dev/null || { apt-get update -qq && apt-get install -y -qq rsync >/dev/null; }
mkdir -p "$W"/{lists/partial,cache/archives/partial,root,bin,src}
KR='[signed-by=/usr/share/keyrings/debian-archive-keyring.gpg]'
cat > "$W/sources.list" <<SL
deb $KR $mirror bullseye main
deb $KR $mirror bookworm main
deb-src $KR $mirror bookworm main
deb-src $KR $security bookworm-security main
SL
APT=(-o Dir::Etc::SourceList="$W/sources.list" -o Dir::Etc::SourceParts=/dev/null -o Dir::State::Lists="$W/lists"
     -o Dir::Cache="$W/cache" -o Dir::State::status=/dev/null -o APT::Sandbox::User=root)
cd "$W/src"
apt-get "${APT[@]}" update -qq
apt-get "${APT[@]}" source -d -qq kubernetes=1.20.5+really1.20.2-1.1+deb12u1
apt-get "${APT[@]}" download -qq golang-1.15-go golang-1.15-src etcd-server
for d in ./*.deb; do dpkg-deb -x "$d" "$W/root"; done
[ -d kubernetes-1.20.2 ] || tar xzf kubernetes_1.20.5+really1.20.2.orig.tar.gz
( export GOROOT="$W/root/usr/lib/go-1.15" CGO_ENABLED=0 GOPROXY=off HOME="$W"
  export GOGC="${GOGC:-400}" GOGCFLAGS="${GOGCFLAGS-all=-l}"
  export PATH="$GOROOT/bin:$PATH"
  cd kubernetes-1.20.2
  make gen_openapi && hack/make-rules/build.sh cmd/kube-apiserver
) >"$W/build.log" 2>&1 || { tail -20 "$W/build.log" >&2; exit 1; }
cp kubernetes-1.20.2/_output/bin/kube-apiserver "$W/root/usr/bin/etcd" "$W/bin/"
rm -rf "$W/src" "$W/cache" "$W/lists" "$W/root/usr/lib/go-1.15" "$W/root/usr/share"
echo "$W/bin"
