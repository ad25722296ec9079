#!/usr/bin/env bash
# Operator walkthrough: the gpu-brokerctl calls that run a shared GPU node.
#
#   examples/operator.sh [LEASE_ID_TO_REVOKE]
#
# Environment:
#   GPU_BROKER_ADDR              broker address (default unix:///run/gpu-broker/broker.sock)
#   GPU_BROKER_ADMIN_TOKEN_FILE  admin token file (default /var/lib/gpu-broker/admin.token;
#                                the broker writes it on first start, mode 0600)
#   GPU_BROKERCTL                the CLI to run (default: gpu-brokerctl on PATH)
set -euo pipefail
ctl="${GPU_BROKERCTL:-gpu-brokerctl}"

# 1. Tenants and quotas. `quota set` creates the tenant or changes only the options given.
#    Sizes take human units; quotas are charged granted sizes (rounded up to 2 MiB).
#    --guaranteed keeps memory available for the tenant (others only borrow it);
#    --priority orders queues (higher first) and lets a tenant reclaim from lower ones.
"$ctl" quota set training --limit 48GiB --max-leases 64 --priority 10 --guaranteed 8GiB
"$ctl" quota set inference --limit 16GiB --priority 5
"$ctl" quota set batch --limit 8GiB --priority -5

# 2. A bearer token for a tenant. It is printed once (the broker keeps only its hash):
#    hand it to the tenant's workers as GPU_BROKER_TOKEN.
token="$("$ctl" tokens issue training --description "operator.sh demo")"
echo "training token: ${token:0:8}... (give it to the workers as GPU_BROKER_TOKEN)"

# 3. Who has what: quotas with live usage, one tenant as JSON (for scripts), tokens
#    (ids and notes, never the secrets), and the devices' memory picture.
"$ctl" tenants list
"$ctl" quota get training --json
"$ctl" tokens list
"$ctl" devices

# 4. Live leases and the sessions (worker processes, with their pids) holding them.
"$ctl" leases list
"$ctl" sessions list

# 5. Take a lease away (e.g. a stuck job). Its holder gets a LeaseRevoked event; the
#    memory stays quarantined until the holder process lets go or exits.
if [[ $# -ge 1 ]]; then
    "$ctl" leases revoke "$1" --reason "revoked by operator.sh"
fi

# 6. Revoke a token (leaked, or its workers are retired): it stops working at once.
"$ctl" tokens revoke "$token"

# 7. A tenant that holds nothing can be deleted (with its tokens).
"$ctl" tenants delete batch
"$ctl" tenants list --json
