#!/usr/bin/env bash
# Run one command on every worker (host) of a TPU VM slice, as one multi-host job.
#
#   scripts/launch_pod.sh [options] TPU_NAME "COMMAND ..."
#
# Every worker gets the same run id and coordinator address and its own rank, through the
# variables tpu_train's distributed start-up reads:
#   MASTER_ADDR   internal IP of worker 0 (the coordinator)
#   MASTER_PORT   --port (default 8476); the JAX coordination service listens on
#                 MASTER_PORT+1, or on TPU_TRAIN_JAX_COORDINATOR, which is set to that too
#   WORLD_SIZE    number of workers (one process per host drives all its local chips)
#   RANK          this worker's index (TPU VM metadata "agent-worker-number")
#   LOCAL_RANK    0 (one process per host)
#   TPU_TRAIN_RUN_ID  the run id shared by all workers (e.g. run.dir=runs/$TPU_TRAIN_RUN_ID)
#
# Options:
#   --zone ZONE            gcloud zone (default: gcloud's configured compute/zone)
#   --project PROJECT      gcloud project (default: gcloud's configured project)
#   --port PORT            MASTER_PORT (default 8476)
#   --run-id ID            run id (default: UTC timestamp + random suffix)
#   --coordinator-ip IP    worker 0's IP; skips the "gcloud ... describe" look-up
#   --num-workers N        worker count; skips the look-up (with --coordinator-ip)
#   --workdir DIR          cd here on each worker first (default: the login directory)
#   --env KEY=VALUE        extra variable for the command (repeatable)
#   --dry-run              print the gcloud commands instead of running them
#   -h, --help             this text
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() { echo "launch_pod.sh: error: $*" >&2; exit 2; }

zone="" project="" port=8476 run_id="" coord_ip="" num_workers="" workdir="" dry_run=0
extra_env=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --zone) zone="${2:?--zone needs a value}"; shift 2 ;;
    --project) project="${2:?--project needs a value}"; shift 2 ;;
    --port) port="${2:?--port needs a value}"; shift 2 ;;
    --run-id) run_id="${2:?--run-id needs a value}"; shift 2 ;;
    --coordinator-ip) coord_ip="${2:?--coordinator-ip needs a value}"; shift 2 ;;
    --num-workers) num_workers="${2:?--num-workers needs a value}"; shift 2 ;;
    --workdir) workdir="${2:?--workdir needs a value}"; shift 2 ;;
    --env) [[ "${2:-}" == *=* ]] || die "--env needs KEY=VALUE, got '${2:-}'"
           extra_env+=("$2"); shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
done
[[ $# -eq 2 ]] || die "expected TPU_NAME and one quoted COMMAND, got $# argument(s) (see --help)"
tpu_name="$1" user_cmd="$2"
[[ "$port" =~ ^[0-9]+$ ]] && (( port > 0 && port < 65535 )) || die "--port must be 1-65534, got '$port'"
[[ -z "$num_workers" || "$num_workers" =~ ^[1-9][0-9]*$ ]] || die "--num-workers must be a positive int"
[[ -n "$run_id" ]] || run_id="$(date -u +%Y%m%d-%H%M%S)-$(printf '%04x' $((RANDOM)))"
[[ "$run_id" =~ ^[A-Za-z0-9._-]+$ ]] || die "--run-id may hold only letters, digits, '.', '_', '-'"

gcloud_opts=()
[[ -n "$zone" ]] && gcloud_opts+=(--zone "$zone")
[[ -n "$project" ]] && gcloud_opts+=(--project "$project")

# Worker 0's address and the worker count come from the TPU's network endpoints (one per host).
describe=(gcloud compute tpus tpu-vm describe "$tpu_name" "${gcloud_opts[@]}"
          --format='value(networkEndpoints[].ipAddress)')
if [[ -z "$coord_ip" || -z "$num_workers" ]]; then
  if (( dry_run )); then
    printf '%q ' "${describe[@]}"; echo
    coord_ip="${coord_ip:-<worker-0-ip>}" num_workers="${num_workers:-<num-workers>}"
  else
    ips="$("${describe[@]}")" || die "could not describe TPU '$tpu_name' (check --zone/--project)"
    IFS=';, ' read -r -a ip_list <<< "$ips"
    [[ ${#ip_list[@]} -gt 0 && -n "${ip_list[0]}" ]] || die "TPU '$tpu_name' reports no workers"
    coord_ip="${coord_ip:-${ip_list[0]}}" num_workers="${num_workers:-${#ip_list[@]}}"
  fi
fi

# The rank is read on each worker from the TPU VM metadata server; TPU_WORKER_ID wins if set.
metadata='http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number'
remote="set -e; "
remote+="RANK=\${TPU_WORKER_ID:-\$(curl -sf -H 'Metadata-Flavor: Google' $metadata)}; "
remote+="export RANK LOCAL_RANK=0 WORLD_SIZE=$num_workers MASTER_ADDR=$coord_ip MASTER_PORT=$port "
remote+="TPU_TRAIN_JAX_COORDINATOR=$coord_ip:$((port + 1)) TPU_TRAIN_RUN_ID=$run_id; "
for kv in "${extra_env[@]+"${extra_env[@]}"}"; do
  remote+="export $(printf '%q' "$kv"); "
done
[[ -n "$workdir" ]] && remote+="cd $(printf '%q' "$workdir"); "
remote+="$user_cmd"

ssh_cmd=(gcloud compute tpus tpu-vm ssh "$tpu_name" "${gcloud_opts[@]}" --worker=all
         --command "$remote")
echo "launch_pod.sh: run $run_id on $num_workers worker(s) of $tpu_name, coordinator $coord_ip:$port" >&2
if (( dry_run )); then
  printf '%q ' "${ssh_cmd[@]}"; echo
else
  exec "${ssh_cmd[@]}"
fi
