#!/usr/bin/env bash
# Write the files the kustomizations turn into Secrets: a CA, the controller's certificate
# (named for its Service), a client certificate for the training pods, the admin token and
# one token per job. Usage: deploy/k8s/make-secrets.sh [NAMESPACE-OF-THE-CONTROLLER]
# Refuses to overwrite: delete deploy/k8s/*/secrets/ to make new ones.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ns=${1:-taskd}
for dir in controller pytorch mindspore; do
    if [ -e "$here/$dir/secrets" ]; then
        echo "$here/$dir/secrets exists; delete deploy/k8s/*/secrets/ to make new secrets" >&2
        exit 1
    fi
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
sign() {  # sign NAME SUBJECT EXTENSIONS
    key "$1.key"
    openssl req -new -key "$1.key" -subj "$2" -out "$1.csr"
    printf '%s\n' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 365 \
        -extfile "$1.ext" -out "$1.pem" 2>/dev/null
}
token() { openssl rand -base64 32 | tr -d '\n' > "$1"; }

key ca.key
openssl req -x509 -new -key ca.key -subj "/CN=taskd-ca" -days 3650 -out ca.pem
svc=taskd-controller
sign controller "/CN=$svc.$ns.svc" \
    "subjectAltName=DNS:$svc,DNS:$svc.$ns,DNS:$svc.$ns.svc,DNS:$svc.$ns.svc.cluster.local
extendedKeyUsage=serverAuth"
sign node "/CN=taskd-node" "extendedKeyUsage=clientAuth"
token admin.token
token pytorch.token
token mindspore.token

place() {  # place DIR FILE[=SOURCE]...
    local dir=$here/$1/secrets
    shift
    mkdir -p "$dir"
    chmod 700 "$dir"
    for spec in "$@"; do
        install -m 600 "${spec#*=}" "$dir/${spec%%=*}"
    done
    echo "wrote $dir"
}
place controller ca.pem=ca.pem controller.pem=controller.pem controller.key=controller.key admin.token=admin.token
place pytorch ca.pem=ca.pem node.pem=node.pem node.key=node.key job.token=pytorch.token
place mindspore ca.pem=ca.pem node.pem=node.pem node.key=node.key job.token=mindspore.token
