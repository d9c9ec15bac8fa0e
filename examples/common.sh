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

# need_flag FLAG[|FLAG2...] "what it is" ARGS...: a flag of the trainer's own that must be among
# ARGS (one of the alternatives). With DRY_RUN=1 a missing one is shown as a <flag> placeholder.
need_flag() {
  local flags="$1" what="$2" flag; shift 2
  for flag in ${flags//|/ }; do
    for a in "$@"; do [ "$a" = "$flag" ] || [[ "$a" == "$flag="* ]] && return 0; done
  done
  flag="${flags%%|*}"
  if [ "$DRY_RUN" = 1 ]; then EXTRA_ARGS+=("$flag" "<${flag#--}>"); else _MISSING+=("${flags//|/ or } (trainer flag): $what"); fi
}

# flag_value FLAG ARGS...: the value the trainer will see for FLAG among ARGS (its last
# occurrence, as `FLAG VALUE` or `FLAG=VALUE`); empty when ARGS do not set it.
flag_value() {
  local flag="$1" value="" prev=""; shift
  for a in "$@"; do
    if [ "$prev" = "$flag" ]; then value="$a"; fi
    if [[ "$a" == "$flag="* ]]; then value="${a#"$flag="}"; fi
    prev="$a"
  done
  printf '%s' "$value"
}

# need_path FLAG "what it is" ARGS...: when ARGS give FLAG, its value must be a path on this machine
# (checked unless DRY_RUN=1, where the user's paths may be the cluster's).
need_path() {
  local flag="$1" what="$2" value; shift 2
  value="$(flag_value "$flag" "$@")"
  if [ -n "$value" ] && [ "$DRY_RUN" != 1 ] && [ ! -e "$value" ]; then
    _MISSING+=("$flag $value: no such file or folder on this machine ($what)")
  fi
}

# refuse "why": a setting that contradicts another; reported with the missing ones.
refuse() { _MISSING+=("$1"); }

# checked: stops with every missing variable and flag named, before anything has started.
checked() {
  if [ "${#_MISSING[@]}" -gt 0 ]; then
    echo "error: $(basename "$0") needs (nothing has been started):" >&2
    printf '  %s\n' "${_MISSING[@]}" >&2
    exit 2
  fi
}

# run CMD...: prints the command (shell-quoted), then runs it unless DRY_RUN=1.
run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  [ "$DRY_RUN" = 1 ] || "$@"
}

# job_env '{"env_vars": {...}}' [NAME=SOURCE...]: sets JOB_ENV, the job's runtime env: the user's
# RUNTIME_ENV_JSON with the example's env_vars merged in (the user's win) and the setup hook that
# registers HISTORY and finds the draft server in every Ray worker. A variable NAME derived from
# SOURCE (a trainer flag) may not be set to something else in the user's runtime env. A conflict is
# reported by `checked`, before anything starts.
job_env() {
  local out
  if out="$(python3 - "$HOOK" "$@" 2>&1 <<'PY'
import json, os, sys
hook, ours, pinned = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
try:
    user = json.loads(os.environ.get("RUNTIME_ENV_JSON") or "{}")
except ValueError as e:
    sys.exit(f"RUNTIME_ENV_JSON: not JSON ({e})")
if user.get("worker_process_setup_hook") not in (None, hook):
    sys.exit(f"RUNTIME_ENV_JSON sets worker_process_setup_hook {user['worker_process_setup_hook']!r}; "
             f"HISTORY needs {hook!r} (call yours from a hook of your own that calls it too)")
for pin in pinned:
    name, _, source = pin.partition("=")
    theirs, mine = user.get("env_vars", {}).get(name), ours["env_vars"][name]
    if theirs is not None and str(theirs) != str(mine):
        sys.exit(f"RUNTIME_ENV_JSON sets {name}={theirs!r}, but {source} makes it {mine!r}: drop it from "
                 f"RUNTIME_ENV_JSON (it follows {source})")
merged = {**ours, **user, "env_vars": {**ours.get("env_vars", {}), **user.get("env_vars", {})},
          "worker_process_setup_hook": hook}
print(json.dumps(merged))
PY
)"; then JOB_ENV="$out"; else _MISSING+=("$out"); fi
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
