# Sourced by the sanitizer scripts (run_forward_sanitizers.sh, run_rms_sanitizers.sh): the one
# line that says whether a tool reported the bug planted in a positive control.
#   control_report NAME TOOL LOG   LOG: the tool's output on the control's binary
control_report() {
  local summary
  summary=$(grep -Eo '(ERROR|RACECHECK) SUMMARY: .*' "$3" | tail -1)
  if [[ "$summary" =~ SUMMARY:\ [1-9] ]]; then
    echo "control $1 ($2): reported: $summary"
  else
    echo "control $1 ($2): NOT reported ($summary) - the check would miss this bug"
  fi
}
