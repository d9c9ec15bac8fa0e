# Sourced by the run_*.sh examples: what each needs is checked before anything starts, the commands
# are printed before they run, and DRY_RUN=1 prints them and starts nothing.
#
#   DRY_RUN=1 bash examples/verl/run_grpo.sh     # the commands it would run; unset variables show as <NAME>
#
# RUNTIME_ENV_JSON (optional): your own Ray runtime env (JSON); the example's env_vars and setup hook
# are merged into it, yours win where both set the same variable.
# DRAFT_DATA (default /ckpt/histospec): the draft server's data directory on the head node.
# RAY_DASHBOARD (default http://127.0.0.1:8265): where `ray job submit` sends the job.
set -euo pipefail
DRY_RUN="${DRY_RUN:-0}"
DRAFT_DATA="${DRAFT_DATA:-/ckpt/histospec}"
RAY_DASHBOARD="${RAY_DASHBOARD:-http://127.0.0.1:8265}"
ACTOR="histospec/histospec-draft-server"
HOOK="histospec_sgl.integrations.ray_setup.setup"
_MISSING=()
_STARTED_DRAFT=0

# need NAME "what it is": a variable the job needs. Missing: collected (an error once all are
# checked), or with DRY_RUN=1 a <NAME> placeholder.
need() {
  if [ -z "${!1:-}" ]; then
    if [ "$DRY_RUN" = 1 ]; then printf -v "$1" '%s' "<$1>"; else _MISSING+=("$1: $2"); fi
  fi
}

# need_flag FLAG "what it is" ARGS...: a flag of the trainer's own that must be among ARGS.
need_flag() {
  local flag="$1" what="$2"; shift 2
  for a in "$@"; do [ "$a" = "$flag" ] || [[ "$a" == "$flag="* ]] && return 0; done
  if [ "$DRY_RUN" = 1 ]; then EXTRA_ARGS+=("$flag" "<${flag#--}>"); else _MISSING+=("$flag (trainer flag): $what"); fi
}

# checked: stops with every missing variable and flag named, before anything has started.
checked() {
  if [ "${#_MISSING[@]}" -gt 0 ]; then
    echo "error: $(basename "$0") needs:" >&2
    printf '  %s\n' "${_MISSING[@]}" >&2
    exit 2
  fi
}

# run CMD...: prints the command (shell-quoted), then runs it unless DRY_RUN=1.
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  [ "$DRY_RUN" = 1 ] || "$@"
}

# runtime_env '{"env_vars": {...}}': the job's runtime env, the user's RUNTIME_ENV_JSON merged in,
# with the setup hook that registers HISTORY and finds the draft server in every Ray worker.
runtime_env() {
  python3 - "$1" "$HOOK" <<'PY'
import json, os, sys
ours, hook = json.loads(sys.argv[1]), sys.argv[2]
user = json.loads(os.environ.get("RUNTIME_ENV_JSON") or "{}")
if user.get("worker_process_setup_hook") not in (None, hook):
    sys.exit(f"error: RUNTIME_ENV_JSON sets worker_process_setup_hook {user['worker_process_setup_hook']!r}; "
             f"HISTORY needs {hook!r} (call yours from a hook of your own that calls it too)")
merged = {**ours, **user, "env_vars": {**ours.get("env_vars", {}), **user.get("env_vars", {})},
          "worker_process_setup_hook": hook}
print(json.dumps(merged))
PY
}

# draft_server: the job's draft server on the head node (a detached Ray actor that makes and hands out
# its token). One this script started is stopped again if the script fails.
draft_server() {
  if [ "$DRY_RUN" != 1 ] && ! histospec-sgl ray draft-server --address auto --status >/dev/null 2>&1; then
    _STARTED_DRAFT=1
  fi
  run histospec-sgl ray draft-server --data-dir "$DRAFT_DATA"
}

_cleanup() {
  local rc=$?
  if [ "$rc" -ne 0 ] && [ "$_STARTED_DRAFT" = 1 ]; then
    echo "$(basename "$0"): failed ($rc); stopping the draft server it started" >&2
    histospec-sgl ray draft-server --stop >/dev/null 2>&1 || true
  fi
  return "$rc"
}
trap _cleanup EXIT
EXTRA_ARGS=()
