# Shared by the GPU round scripts (source it): `run NAME LIMIT CMD...` runs CMD under
# `timeout LIMIT`, its output in $LOG_DIR/NAME.log, a line "NAME rc=... Ns total, Ms" appended
# to $LOG_DIR/steps.txt and echoed, then the log's last $TAIL_LINES lines (default 6).
run() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$LOG_DIR/$name.log" 2>&1
  echo "$name rc=$? ${SECONDS}s total, $(( $(date +%s) - t0 ))s" | tee -a "$LOG_DIR/steps.txt"
  tail -n "${TAIL_LINES:-6}" "$LOG_DIR/$name.log"
}
