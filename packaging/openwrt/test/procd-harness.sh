#!/bin/sh
# shellcheck shell=ash
# Runs one function of an OpenWrt procd init script against a UCI config file, with the
# functions rc.common, /lib/functions.sh and procd.sh would provide replaced by stubs that
# print what the script asked procd for. Written for busybox ash (OpenWrt's shell); dash
# runs it too.
#
#   procd-harness.sh INIT_SCRIPT UCI_FILE FUNCTION
#
# FUNCTION is start_service, reload_service, service_triggers or shutdown. Output, one item per line:
#   instance                  procd_open_instance
#   command <arg>             each argument of the instance's command, in order
#   <param> <value>           each value of any other procd_set_param
#   end                       procd_close_instance
#   reload_trigger <config>   procd_add_reload_trigger
#   logger <args>             a logger call
#   stop | sleep <n>          the stop and each sleep of a shutdown
#   start                     the start of a reload
#   return <status>           what FUNCTION returned
# Set HARNESS_ALIVE=N to have pidof find the agent N times.
set -u

[ $# -eq 3 ] || {
	echo "usage: $0 INIT_SCRIPT UCI_FILE FUNCTION" >&2
	exit 2
}
HARNESS_INIT=$1
HARNESS_UCI=$2
HARNESS_FN=$3
HARNESS_ALIVE=${HARNESS_ALIVE:-0}

# ---- UCI, as /lib/functions.sh and uci_load present it -------------------------------
# A /etc/config file is a list of `config TYPE NAME`, `option NAME VALUE` and
# `list NAME VALUE` lines; sourcing it with these three defined loads it into
# CONFIG_<section>_<option> variables, the way `uci export` output is evaluated.
HARNESS_SECTION=
config() {
	HARNESS_SECTION=$2
	eval "CONFIG_${2}_TYPE=\$1"
}
option() {
	local name="$1"
	shift
	eval "CONFIG_${HARNESS_SECTION}_${name}=\$*"
}
list() {
	local name="$1" len
	shift
	eval "len=\${CONFIG_${HARNESS_SECTION}_${name}_LENGTH:-0}"
	len=$((len + 1))
	eval "CONFIG_${HARNESS_SECTION}_${name}_ITEM${len}=\$*"
	eval "CONFIG_${HARNESS_SECTION}_${name}_LENGTH=\$len"
}
config_load() {
	# shellcheck disable=SC1090 # the file is an argument
	. "$HARNESS_UCI"
}
# config_get VAR SECTION OPTION [DEFAULT]: an unset or empty option gives DEFAULT.
config_get() {
	eval "$1=\${CONFIG_${2}_${3}:-\${4:-}}"
}
config_get_bool() {
	local value
	config_get value "$2" "$3" "${4:-}"
	case "$value" in
	1 | on | true | yes | enabled) value=1 ;;
	0 | off | false | no | disabled) value=0 ;;
	*) value=${4:-} ;;
	esac
	eval "$1=\$value"
}
config_list_foreach() {
	local section="$1" name="$2" fn="$3" len i=1 item
	shift 3
	eval "len=\${CONFIG_${section}_${name}_LENGTH:-0}"
	while [ "$i" -le "$len" ]; do
		eval "item=\${CONFIG_${section}_${name}_ITEM${i}}"
		"$fn" "$item" "$@"
		i=$((i + 1))
	done
}

# ---- procd.sh ------------------------------------------------------------------------
procd_open_instance() { echo instance; }
procd_close_instance() { echo end; }
procd_set_param() {
	local param="$1" arg
	shift
	for arg in "$@"; do
		echo "$param $arg"
	done
}
procd_append_param() { procd_set_param "$@"; }
procd_add_reload_trigger() { echo "reload_trigger $*"; }

# ---- the rest of the system --------------------------------------------------------------
logger() { echo "logger $*"; }
stop() { echo stop; }
start() { echo start; }
sleep() { echo "sleep $1"; }
pidof() {
	[ "$HARNESS_ALIVE" -gt 0 ] || return 1
	HARNESS_ALIVE=$((HARNESS_ALIVE - 1))
	echo 4242
}

# shellcheck disable=SC1090 # the script under test
. "$HARNESS_INIT"
"$HARNESS_FN"
echo "return $?"
