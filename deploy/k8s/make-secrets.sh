#!/usr/bin/env bash
# Write the files the kustomizations turn into Secrets: a CA, the controller's certificate
# (named for its Service and its replicas), a client certificate for the training pods, the
# admin token, one token per job, and for etcd its members' serving and peer certificates and
# the controllers' client certificate (a CA of its own).
# Usage: deploy/k8s/make-secrets.sh [NAMESPACE-OF-THE-CONTROLLER]
# Refuses to overwrite: delete deploy/k8s/*/secrets/ to make new ones.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ns=${1:-taskd}
for dir in controller etcd pytorch mindspore; do
    if [ -e "$here/$dir/secrets" ]; then
        echo "$here/$dir/secrets exists; delete deploy/k8s/*/secrets/ to make new secrets" >&2
        exit 1
    fi
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
sign() {  # sign NAME SUBJECT EXTENSIONS [CA]
    local ca=${4:-ca}
    key "$1.key"
    openssl req -new -key "$1.key" -subj "$2" -out "$1.csr"
    printf '%s\n' "$3" > "$1.ext"
    openssl x509 -req -in "$1.csr" -CA "$ca.pem" -CAkey "$ca.key" -CAcreateserial -days 365 \
        -extfile "$1.ext" -out "$1.pem" 2>/dev/null
}
token() { openssl rand -base64 32 | tr -d '\n' > "$1"; }

key ca.key
openssl req -x509 -new -key ca.key -subj "/CN=taskd-ca" -days 3650 -out ca.pem
svc=taskd-controller
# The Service's names, and each replica's under the headless Service (what standbys advertise).
sign controller "/CN=$svc.$ns.svc" \
    "subjectAltName=DNS:$svc,DNS:$svc.$ns,DNS:$svc.$ns.svc,DNS:$svc.$ns.svc.cluster.local,DNS:*.$svc-peers.$ns.svc.cluster.local
extendedKeyUsage=serverAuth"
sign node "/CN=taskd-node" "extendedKeyUsage=clientAuth"
token admin.token
token pytorch.token
token mindspore.token

# etcd: its own CA; members serve and peer under their StatefulSet names (localhost too, for
# etcdctl inside a pod); the controllers show a client certificate.
key etcd-ca.key
openssl req -x509 -new -key etcd-ca.key -subj "/CN=taskd-etcd-ca" -days 3650 -out etcd-ca.pem
members="DNS:taskd-etcd.$ns.svc.cluster.local,DNS:*.taskd-etcd.$ns.svc.cluster.local,DNS:localhost,IP:127.0.0.1"
for n in 0 1 2; do members="$members,DNS:taskd-etcd-$n.taskd-etcd.$ns.svc.cluster.local"; done
sign etcd-server "/CN=taskd-etcd" "subjectAltName=$members
extendedKeyUsage=serverAuth" etcd-ca
sign etcd-peer "/CN=taskd-etcd" "subjectAltName=$members
extendedKeyUsage=serverAuth,clientAuth" etcd-ca
sign etcd-client "/CN=taskd-controller" "extendedKeyUsage=clientAuth" etcd-ca

place() {  # place DIR FILE[=SOURCE]...
    local dir=$here/$1/secrets
    shift
    mkdir -p "$dir"
    chmod 700 "$dir"
    for spec in "$@"; do
        install -D -m 600 "${spec#*=}" "$dir/${spec%%=*}"
    done
    echo "wrote $dir"
}
place controller ca.pem=ca.pem controller.pem=controller.pem controller.key=controller.key admin.token=admin.token \
    etcd/ca.pem=etcd-ca.pem etcd/client.pem=etcd-client.pem etcd/client.key=etcd-client.key
place etcd ca.pem=etcd-ca.pem server.pem=etcd-server.pem server.key=etcd-server.key peer.pem=etcd-peer.pem \
    peer.key=etcd-peer.key
place pytorch ca.pem=ca.pem node.pem=node.pem node.key=node.key job.token=pytorch.token
place mindspore ca.pem=ca.pem node.pem=node.pem node.key=node.key job.token=mindspore.token
