#!/usr/bin/env python3
"""pxed lab controller: real power control of QEMU VMs behind sushy-tools' fake Redfish BMC.

sushy-emulator --fake keeps each system's state (power, boot device) and PUTs the whole
system as JSON to EXTERNAL_NOTIFICATION_URL on every change. This controller is that URL:
it starts a QEMU VM when a system's power_state becomes On, kills it when it becomes Off,
boots it from the network while a Pxe override is pending (and then consumes the override,
as a BMC does with BootSourceOverrideEnabled=Once), restarts it after a guest reboot and
reports a guest poweroff back to the BMC. Python 3 standard library only.

  controller.py start  --lab LAB.json   run in the foreground until SIGTERM/SIGINT
  controller.py stop   --lab LAB.json   kill whatever a (crashed) run of this lab left behind
  controller.py status --lab LAB.json   pids, BMC power state and boot target per VM
  controller.py qemu-cmd --lab LAB.json --vm NAME [--boot network|disk]   print the QEMU command

See lab/README.md for the lab file, the event log and the observed sushy payloads.
"""
import argparse
import base64
import json
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SUSHY_VENV = os.environ.get("SUSHY_VENV", "/tmp/pxed-peers/venv")
IN_NETNS_ENV = "PXLAB_IN_NETNS"

FIRMWARE = {
    # x86_64 UEFI; NIC without option ROM so OVMF's own VirtioNetDxe + PxeBcDxe do the PXE boot
    "ovmf": {
        "qemu": "qemu-system-x86_64",
        "machine": ["-machine", "q35", "-accel", "tcg"],
        "code": "/usr/share/OVMF/OVMF_CODE_4M.fd",
        "vars": "/usr/share/OVMF/OVMF_VARS_4M.fd",
        "nic": "virtio-net-pci",
        "romfile": "",
    },
    # x86_64 BIOS: SeaBIOS + iPXE NIC ROM (QEMU's default ROM for the NIC model, from ipxe-qemu)
    "seabios": {
        "qemu": "qemu-system-x86_64",
        "machine": ["-machine", "pc", "-accel", "tcg"],
        "bios": "/usr/share/seabios/bios-256k.bin",
        "nic": "e1000",
        "romfile": None,
    },
    # arm64 UEFI (AAVMF); EDK2's own PXE on virtio-net
    "aavmf": {
        "qemu": "qemu-system-aarch64",
        "machine": ["-machine", "virt", "-cpu", "cortex-a57", "-accel", "tcg"],
        "code": "/usr/share/AAVMF/AAVMF_CODE.fd",
        "vars": "/usr/share/AAVMF/AAVMF_VARS.fd",
        "nic": "virtio-net-pci",
        "romfile": "",
    },
}


def now():
    return time.time()


def iso(ts):
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + ".%03dZ" % int((ts % 1) * 1000)


# ---------------------------------------------------------------- lab file

class Lab:
    def __init__(self, path):
        self.path = os.path.abspath(path)
        with open(path) as f:
            d = json.load(f)
        self.raw = d
        self.name = d.get("name", "lab")
        self.state_dir = os.path.abspath(d.get("state_dir") or os.path.join(os.path.dirname(self.path), "state"))
        self.netns = d.get("netns")
        rf = d.get("redfish", {})
        self.rf_host = rf.get("host", "127.0.0.1")
        self.rf_port = int(rf.get("port", 8000))
        self.rf_user = rf.get("user", "admin")
        self.rf_password = rf.get("password", "password")
        nt = d.get("notify", {})
        self.nt_host = nt.get("host", "127.0.0.1")
        self.nt_port = int(nt.get("port", 9999))
        # once | continuous | ignored (a BMC that accepts the override and reads it back,
        # while the machine boots its disk anyway: the fault pxed must catch)
        self.override = d.get("pxe_override", "once")
        if self.override not in ("once", "continuous", "ignored"):
            raise SystemExit("pxe_override must be once, continuous or ignored")
        self.stop_timeout = float(d.get("stop_timeout", 5))
        self.vms = []
        seen = set()
        for v in d.get("vms", []):
            vm = VmSpec(v, self)
            if vm.name in seen or vm.uuid in seen:
                raise SystemExit(f"duplicate VM name/uuid {vm.name}")
            seen.update({vm.name, vm.uuid})
            self.vms.append(vm)

    def p(self, *parts):
        return os.path.join(self.state_dir, *parts)

    @property
    def rf_base(self):
        return f"http://{self.rf_host}:{self.rf_port}"

    @property
    def notify_url(self):
        return f"http://{self.nt_host}:{self.nt_port}/notify"


class VmSpec:
    def __init__(self, v, lab):
        for k in ("name", "uuid", "mac", "firmware", "disk", "tap"):
            if k not in v:
                raise SystemExit(f"VM {v.get('name', '?')}: missing {k}")
        self.name = v["name"]
        self.uuid = v["uuid"].lower()
        self.mac = v["mac"].lower()
        self.firmware = v["firmware"]
        if self.firmware not in FIRMWARE:
            raise SystemExit(f"VM {self.name}: firmware must be one of {sorted(FIRMWARE)}")
        fw = FIRMWARE[self.firmware]
        self.disk = os.path.abspath(v["disk"])
        self.disk_format = v.get("disk_format") or ("raw" if self.disk.endswith((".raw", ".img")) else "qcow2")
        self.disk_size = v.get("disk_size", "4G")
        self.tap = v["tap"]
        self.memory = int(v.get("memory", 1024 if self.firmware == "aavmf" else 512))
        self.cpus = int(v.get("cpus", 1))
        self.netns = v.get("netns", lab.netns)
        self.nic = v.get("nic", fw["nic"])
        self.romfile = v.get("romfile", fw["romfile"])
        self.ip = v.get("ip")
        self.extra_args = list(v.get("extra_args", []))
        # A JSON list of more QEMU arguments, read at every start: the lab changes the
        # machine's hardware between reinstalls (a card pulled, a link narrowed) through it.
        self.extra_args_file = v.get("extra_args_file")
        self.console = os.path.abspath(v.get("console") or lab.p(f"{self.name}.console.log"))
        self.events = os.path.abspath(v.get("events") or lab.p(f"{self.name}.events.jsonl"))
        self.pidfile = lab.p(f"{self.name}.qemu.pid")
        self.qmp = lab.p(f"{self.name}.qmp")
        self.qemu_log = lab.p(f"{self.name}.qemu.log")
        self.vars = lab.p(f"{self.name}.vars.fd")
        self.firmware_log = lab.p(f"{self.name}.firmware.log")
        self.lab = lab


def qemu_command(vm, boot):
    """The QEMU command line for booting `vm` from `boot` ('network' or 'disk')."""
    fw = FIRMWARE[vm.firmware]
    cmd = [fw["qemu"], "-name", f"pxlab-{vm.name}", "-nodefaults", "-display", "none", "-no-reboot"]
    cmd += fw["machine"] + ["-m", str(vm.memory), "-smp", str(vm.cpus), "-uuid", vm.uuid]
    if "code" in fw:
        cmd += ["-drive", f"if=pflash,format=raw,readonly=on,file={fw['code']}",
                "-drive", f"if=pflash,format=raw,file={vm.vars}"]
    else:
        # SeaBIOS prints to VGA only: its debug port (0x402) gives the boot decisions in a file
        cmd += ["-bios", fw["bios"], "-chardev", f"file,id=fwlog,path={vm.firmware_log},append=on",
                "-device", "isa-debugcon,iobase=0x402,chardev=fwlog"]
    nic_bi = ",bootindex=0" if boot == "network" else ""
    disk_bi = ",bootindex=1" if boot == "network" else ",bootindex=0"
    rom = "" if vm.romfile is None else f",romfile={vm.romfile}"
    cmd += ["-netdev", f"tap,id=n0,ifname={vm.tap},script=no,downscript=no",
            "-device", f"{vm.nic},netdev=n0,mac={vm.mac}{rom}{nic_bi}"]
    cmd += ["-drive", f"file={vm.disk},format={vm.disk_format},if=none,id=d0,cache=unsafe",
            "-device", f"virtio-blk-pci,drive=d0{disk_bi}"]
    cmd += ["-chardev", f"file,id=con0,path={vm.console},append=on", "-serial", "chardev:con0",
            "-qmp", f"unix:{vm.qmp},server=on,wait=off", "-pidfile", vm.pidfile]
    cmd += vm.extra_args
    if vm.extra_args_file and os.path.exists(vm.extra_args_file):
        with open(vm.extra_args_file) as f:
            cmd += [str(a) for a in json.load(f)]
    return cmd


# ---------------------------------------------------------------- processes

def pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def read_pid(path):
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def write_pid(path, pid):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{pid}\n")
    os.replace(tmp, path)


def kill_pid(pid, timeout=5.0, proc=None):
    """SIGTERM, then SIGKILL after `timeout`. Returns 'absent', 'SIGTERM' or 'SIGKILL'."""
    if not pid_alive(pid):
        if proc:
            proc.poll()
        return "absent"
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return "absent"
    deadline = now() + timeout
    while now() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return "SIGTERM"
        elif not pid_alive(pid):
            return "SIGTERM"
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc is not None:
        proc.wait()
    else:
        for _ in range(100):
            if not pid_alive(pid):
                break
            time.sleep(0.05)
    return "SIGKILL"


def tap_exists(tap, ns):
    if not ns or ns == os.environ.get(IN_NETNS_ENV):
        return os.path.exists(f"/sys/class/net/{tap}")
    return subprocess.run(["ip", "-n", ns, "link", "show", tap], capture_output=True).returncode == 0


def netns_wrap(ns, cmd):
    cur = os.environ.get(IN_NETNS_ENV)
    if ns and ns != cur:
        return ["ip", "netns", "exec", ns] + cmd
    return cmd


# ---------------------------------------------------------------- Redfish client

class Redfish:
    def __init__(self, lab):
        self.base = lab.rf_base
        tok = base64.b64encode(f"{lab.rf_user}:{lab.rf_password}".encode()).decode()
        self.auth = "Basic " + tok

    def req(self, method, path, body=None, timeout=10):
        data = None if body is None else json.dumps(body).encode()
        r = urllib.request.Request(self.base + path, data=data, method=method)
        r.add_header("Authorization", self.auth)
        if data is not None:
            r.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(r, timeout=timeout) as resp:
                raw = resp.read()
                return resp.status, (json.loads(raw) if raw.strip() else None)
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def system(self, uuid):
        return self.req("GET", f"/redfish/v1/Systems/{uuid}")

    def reset(self, uuid, kind):
        return self.req("POST", f"/redfish/v1/Systems/{uuid}/Actions/ComputerSystem.Reset", {"ResetType": kind})

    def set_boot(self, uuid, target, enabled):
        return self.req("PATCH", f"/redfish/v1/Systems/{uuid}",
                        {"Boot": {"BootSourceOverrideTarget": target, "BootSourceOverrideEnabled": enabled}})


# ---------------------------------------------------------------- the controller

class Vm:
    def __init__(self, spec):
        self.spec = spec
        self.bmc_power = "Off"      # last power_state the BMC reported
        self.pending = None         # last pending_power the BMC reported
        self.boot_device = "Hdd"    # last boot_device the BMC reported
        self.proc = None            # running QEMU (subprocess.Popen)
        self.gen = 0                # incremented per QEMU start; exit events of older starts are stale
        self.boot = None            # boot device of the running QEMU
        self.expected_exit = False  # we are stopping it
        self.network_boots = 0
        self.lock = threading.Lock()
        self.ev_lock = threading.Lock()

    def log(self, **kw):
        ts = now()
        rec = {"time": iso(ts), "ts": round(ts, 3), "vm": self.spec.name}
        rec.update(kw)
        line = json.dumps(rec, sort_keys=False)
        with self.ev_lock, open(self.spec.events, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)


class Controller:
    def __init__(self, lab, args):
        self.lab = lab
        self.args = args
        self.vms = {s.uuid: Vm(s) for s in lab.vms}
        self.q = queue.Queue()
        self.rf = Redfish(lab)
        self.sushy = None
        self.httpd = None
        self.stopping = threading.Event()
        self.notify_log = lab.p("notifications.jsonl")

    # ---- setup
    def prepare(self):
        lab = self.lab
        os.makedirs(lab.state_dir, exist_ok=True)
        for vm in lab.vms:
            fw = FIRMWARE[vm.firmware]
            if not shutil.which(fw["qemu"]):
                print(f"warning: {fw['qemu']} not found: VM {vm.name} cannot start", file=sys.stderr)
            for d in (os.path.dirname(vm.console), os.path.dirname(vm.events), os.path.dirname(vm.disk)):
                os.makedirs(d, exist_ok=True)
            if not os.path.exists(vm.disk):
                subprocess.run(["qemu-img", "create", "-q", "-f", vm.disk_format, vm.disk, str(vm.disk_size)], check=True)
            if "vars" in fw and (not os.path.exists(vm.vars) or not self.args.keep_state):
                shutil.copyfile(fw["vars"], vm.vars)
            for p in (vm.qmp, vm.pidfile):
                if os.path.exists(p):
                    os.unlink(p)

    def write_sushy_config(self):
        lab = self.lab
        htpasswd = lab.p("sushy.htpasswd")
        py = os.path.join(SUSHY_VENV, "bin", "python3")
        h = subprocess.run([py, "-c", "import bcrypt,sys;print(bcrypt.hashpw(sys.argv[1].encode(),"
                            "bcrypt.gensalt(rounds=5)).decode())", lab.rf_password],
                           check=True, capture_output=True, text=True).stdout.strip()
        with open(htpasswd, "w") as f:
            f.write(f"{lab.rf_user}:{h}\n")
        systems = []
        for vm in lab.vms:
            nic = {"mac": vm.mac}
            if vm.ip:
                nic["ip"] = vm.ip
            systems.append({"uuid": vm.uuid, "name": vm.name, "power_state": "Off",
                            "boot_mode": "Legacy" if vm.firmware == "seabios" else "UEFI",
                            "external_notifier": True, "nics": [nic]})
        state = lab.p("sushy-state")
        if not self.args.keep_state and os.path.isdir(state):
            shutil.rmtree(state)  # the fake driver ignores the config for systems already in its state
        os.makedirs(state, exist_ok=True)
        conf = lab.p("sushy.conf")
        with open(conf, "w") as f:
            f.write("# written by lab/controller.py\n")
            f.write(f"SUSHY_EMULATOR_LISTEN_IP = {lab.rf_host!r}\n")
            f.write(f"SUSHY_EMULATOR_LISTEN_PORT = {lab.rf_port!r}\n")
            f.write(f"SUSHY_EMULATOR_AUTH_FILE = {htpasswd!r}\n")
            f.write(f"SUSHY_EMULATOR_STATE_DIR = {state!r}\n")
            f.write(f"SUSHY_EMULATOR_FAKE_SYSTEMS = {systems!r}\n")
            f.write(f"EXTERNAL_NOTIFICATION_URL = {lab.notify_url!r}\n")
        return conf

    def start_sushy(self, conf):
        exe = os.path.join(SUSHY_VENV, "bin", "sushy-emulator")
        log = open(self.lab.p("sushy.log"), "ab")
        self.sushy = subprocess.Popen(netns_wrap(self.lab.netns, [exe, "--config", conf, "--fake"]),
                                      stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True)
        log.close()
        write_pid(self.lab.p("sushy.pid"), self.sushy.pid)
        deadline = now() + 30
        while now() < deadline:
            if self.sushy.poll() is not None:
                raise RuntimeError(f"sushy-emulator exited rc={self.sushy.returncode}, see {self.lab.p('sushy.log')}")
            try:
                st, _ = self.rf.req("GET", "/redfish/v1/Systems", timeout=2)
                if st == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.3)
        raise RuntimeError("sushy-emulator did not answer within 30 s")

    def start_listener(self):
        ctl = self

        class H(BaseHTTPRequestHandler):
            def do_PUT(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                try:
                    system = json.loads(body)
                except ValueError:
                    self.send_response(400)
                    self.end_headers()
                    return
                with open(ctl.notify_log, "a") as f:
                    f.write(json.dumps({"time": iso(now()), "ts": round(now(), 3), "payload": system}) + "\n")
                ctl.q.put(("notify", system))
                # answer at once: sushy waits for us inside its own request handling
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_POST = do_PUT

            def log_message(self, *a):
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.httpd = ThreadingHTTPServer((self.lab.nt_host, self.lab.nt_port), H)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="listener").start()

    # ---- main loop
    def run(self):
        self.prepare()
        write_pid(self.lab.p("controller.pid"), os.getpid())
        conf = self.write_sushy_config()
        self.start_listener()
        self.start_sushy(conf)
        print(json.dumps({"time": iso(now()), "event": "ready", "redfish": self.lab.rf_base,
                          "notify": self.lab.notify_url, "netns": self.lab.netns,
                          "state_dir": self.lab.state_dir}), flush=True)
        with open(self.lab.p("ready"), "w") as f:
            f.write(f"{self.lab.rf_base}\n")
        try:
            while not self.stopping.is_set():
                try:
                    item = self.q.get(timeout=0.25)
                except queue.Empty:
                    item = None
                if item is not None:
                    try:
                        self.handle(item)
                    except Exception as e:  # keep the lab running; the event log says what failed
                        import traceback
                        traceback.print_exc()
                        if item[0] == "notify":
                            vm = self.vms.get(str(item[1].get("uuid", "")).lower())
                        else:
                            vm = item[1]
                        if vm:
                            vm.log(action="error", detail=f"{type(e).__name__}: {e}")
                if self.sushy.poll() is not None:
                    print(f"sushy-emulator exited rc={self.sushy.returncode}", file=sys.stderr)
                    break
                self.drive_pending()
        finally:
            self.shutdown()

    def drive_pending(self):
        """The fake driver applies a pending power change only when the system is read after
        its apply_time (1-11 s after the request): read it then, as pxed's polling would."""
        t = now()
        for vm in self.vms.values():
            p = vm.pending
            if p and t >= float(p.get("apply_time", 0)) + 0.1 and t >= getattr(vm, "next_poll", 0):
                vm.next_poll = t + 1.0
                try:
                    self.rf.system(vm.spec.uuid)  # notification(s) arrive through the listener
                except (OSError, urllib.error.URLError) as e:
                    print(f"poll {vm.spec.name}: {e}", file=sys.stderr)

    def handle(self, item):
        kind = item[0]
        if kind == "notify":
            self.on_notify(item[1])
        elif kind == "exit":
            self.on_exit(*item[1:])

    def on_notify(self, system):
        vm = self.vms.get(str(system.get("uuid", "")).lower())
        if vm is None:
            return
        new = system.get("power_state")
        old = vm.bmc_power
        vm.pending = system.get("pending_power")
        vm.boot_device = system.get("boot_device", "Hdd")
        vm.bmc_power = new
        bmc = {"power_state": new, "pending_power": vm.pending, "boot_device": vm.boot_device}
        if system.get("boot_mode"):
            bmc["boot_mode"] = system["boot_mode"]
        if vm.pending:
            asked = f"power {vm.pending.get('power_state')} (applies at {iso(float(vm.pending.get('apply_time', 0)))})"
        elif new != old:
            asked = f"power {new}"
        else:
            asked = f"boot {vm.boot_device}" + (f" {system['boot_mode']}" if system.get("boot_mode") else "")
        if new == old:
            vm.log(asked=asked, bmc=bmc, action="none", why="power unchanged")
            return
        if new == "On":
            if vm.proc is not None:
                vm.log(asked=asked, bmc=bmc, action="none", why="already running", boot=vm.boot)
                return
            self.start_vm(vm, bmc, reason="power-on", asked=asked)
        elif new == "Off":
            if vm.proc is None:
                vm.log(asked=asked, bmc=bmc, action="none", why="already stopped")
                return
            how = self.stop_vm(vm)
            vm.log(asked=asked, bmc=bmc, action="stop", how=how, why="power-off")

    def boot_for(self, target):
        if target == "Pxe":
            return "network"
        return "disk"  # Hdd, None, Cd (no virtual media here), UefiHttp is turned into Pxe by sushy

    def start_vm(self, vm, bmc, reason, asked=None):
        s = vm.spec
        target = bmc.get("boot_device") or "Hdd"
        boot = self.boot_for(target)
        extra = {}
        if asked:
            extra["asked"] = asked
        fw_mode = "Legacy" if s.firmware == "seabios" else "UEFI"
        if bmc.get("boot_mode") and bmc["boot_mode"] != fw_mode:
            extra["note"] = f"BootSourceOverrideMode {bmc['boot_mode']} ignored: {s.firmware} is {fw_mode}"
        if target not in ("Pxe", "Hdd", "None"):
            extra["note"] = f"target {target} not emulated: booting the disk"
        if boot == "network" and self.lab.override == "ignored":
            boot = "disk"
            extra["note"] = "pxe_override=ignored: the override is not applied, booting the disk"
        cmd = netns_wrap(s.netns, qemu_command(s, boot))
        if not tap_exists(s.tap, s.netns):
            # QEMU (as root) would create a fresh tap on no bridge: a VM on no network
            vm.log(bmc=bmc, action="start-failed", boot=boot, reason=reason,
                   detail=f"tap {s.tap} does not exist in netns {s.netns or '(host)'}", **extra)
            self.report_off(vm, "tap missing")
            return
        qlog = open(s.qemu_log, "ab")
        qlog.write(f"\n=== {iso(now())} start boot={boot} reason={reason}\n{shlex.join(cmd)}\n".encode())
        qlog.flush()
        if os.path.exists(s.qmp):
            os.unlink(s.qmp)
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=qlog, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as e:
            qlog.close()
            vm.log(bmc=bmc, action="start-failed", boot=boot, reason=reason, detail=str(e), **extra)
            self.report_off(vm, "qemu could not be started")
            return
        qlog.close()
        vm.gen += 1
        vm.proc = proc
        vm.boot = boot
        vm.expected_exit = False
        if boot == "network":
            vm.network_boots += 1
        write_pid(s.pidfile + ".ctl", proc.pid)  # QEMU writes s.pidfile itself; this one exists at once
        vm.log(bmc=bmc, action="start", boot=boot, reason=reason, pid=proc.pid, target=target, **extra)
        threading.Thread(target=self.watch, args=(vm, proc, vm.gen), daemon=True, name=f"qmp-{s.name}").start()
        if boot == "network" and self.lab.override == "once":
            # the one-time override is consumed by this boot: the next boot is from the disk
            st, body = self.rf.set_boot(s.uuid, "Hdd", "Disabled")
            vm.log(bmc=bmc, action="consume-override", boot=boot, detail=f"PATCH Boot Hdd -> {st}")

    def stop_vm(self, vm):
        proc = vm.proc
        if proc is None:
            return "absent"
        vm.expected_exit = True
        how = kill_pid(proc.pid, self.lab.stop_timeout, proc)
        vm.proc = None
        for p in (vm.spec.pidfile, vm.spec.pidfile + ".ctl"):
            if os.path.exists(p):
                os.unlink(p)
        return how

    def watch(self, vm, proc, gen):
        """Follow QEMU's QMP events; on exit, queue ('exit', vm, gen, reason, rc)."""
        reason = None
        sock = None
        deadline = now() + 30
        while now() < deadline and proc.poll() is None:
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(vm.spec.qmp)
                break
            except OSError:
                sock.close()
                sock = None
                time.sleep(0.1)
        if sock is not None:
            try:
                f = sock.makefile("rwb", buffering=0)
                f.readline()  # greeting
                f.write(b'{"execute":"qmp_capabilities"}\n')
                for line in f:
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    if msg.get("event") == "SHUTDOWN":
                        reason = msg.get("data", {}).get("reason")
            except OSError:
                pass
            finally:
                sock.close()
        rc = proc.wait()
        self.q.put(("exit", vm, gen, reason, rc))

    def on_exit(self, vm, gen, reason, rc):
        if gen != vm.gen or vm.proc is None:
            return  # an old QEMU we already stopped ourselves
        vm.proc = None
        for p in (vm.spec.pidfile, vm.spec.pidfile + ".ctl"):
            if os.path.exists(p):
                os.unlink(p)
        if vm.expected_exit:
            return
        if reason in ("guest-reset", "host-qmp-system-reset") and vm.bmc_power == "On":
            vm.log(action="exited", qemu_reason=reason, rc=rc, boot=vm.boot)
            st, sysd = self.rf.system(vm.spec.uuid)
            target = sysd.get("Boot", {}).get("BootSourceOverrideTarget") if st == 200 and isinstance(sysd, dict) else vm.boot_device
            bmc = {"power_state": vm.bmc_power, "boot_device": target or "Hdd", "source": "GET after guest reset"}
            if st == 200 and isinstance(sysd, dict) and sysd.get("Boot", {}).get("BootSourceOverrideMode"):
                bmc["boot_mode"] = sysd["Boot"]["BootSourceOverrideMode"]
            self.start_vm(vm, bmc, reason="guest-reset")
            return
        why = {"guest-shutdown": "guest powered off", "guest-panic": "guest panicked"}.get(reason, f"qemu exited ({reason}, rc={rc})")
        extra = {}
        if reason is None and rc != 0:
            try:
                with open(vm.spec.qemu_log, "rb") as f:
                    f.seek(max(0, os.path.getsize(vm.spec.qemu_log) - 400))
                    extra["qemu_output"] = f.read().decode(errors="replace").strip().splitlines()[-3:]
            except OSError:
                pass
        vm.log(action="exited", qemu_reason=reason, rc=rc, boot=vm.boot, why=why, **extra)
        self.report_off(vm, why)

    def report_off(self, vm, why):
        if vm.bmc_power == "Off" and not vm.pending:
            return
        st, body = self.rf.reset(vm.spec.uuid, "ForceOff")
        vm.log(action="bmc-force-off", why=why, detail=f"POST Reset ForceOff -> {st}")

    # ---- teardown
    def request_stop(self, *_):
        self.stopping.set()

    def shutdown(self):
        for vm in self.vms.values():
            if vm.proc is not None:
                how = self.stop_vm(vm)
                vm.log(action="stop", how=how, why="controller shutdown")
        if self.sushy is not None:
            kill_pid(self.sushy.pid, 5, self.sushy)
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        for n in ("sushy.pid", "controller.pid", "ready"):
            try:
                os.unlink(self.lab.p(n))
            except FileNotFoundError:
                pass


# ---------------------------------------------------------------- commands

def enter_netns(lab, argv):
    """Re-exec this controller inside the lab's netns so sushy, the listener and QEMU share it."""
    if lab.netns and os.environ.get(IN_NETNS_ENV) != lab.netns:
        env = dict(os.environ, **{IN_NETNS_ENV: lab.netns})
        os.execvpe("ip", ["ip", "netns", "exec", lab.netns, sys.executable, os.path.abspath(__file__)] + argv, env)


def cmd_start(args, argv):
    lab = Lab(args.lab)
    enter_netns(lab, argv)
    old = read_pid(lab.p("controller.pid"))
    if old and pid_alive(old) and "controller.py" in cmdline(old):
        raise SystemExit(f"controller already running as pid {old}; run `stop --lab {args.lab}` first")
    cmd_stop(args, quiet=True)  # leftovers of a crashed run
    ctl = Controller(lab, args)
    signal.signal(signal.SIGTERM, ctl.request_stop)
    signal.signal(signal.SIGINT, ctl.request_stop)
    signal.signal(signal.SIGHUP, ctl.request_stop)
    ctl.run()


def cmd_stop(args, quiet=False):
    """Kill what a run of this lab left: the controller first (it stops its children), then
    sushy and every QEMU whose pid file is still there. Each pid is checked against its
    command line first, so a recycled pid is never killed."""
    lab = Lab(args.lab)
    done = []
    checks = [("controller.pid", "controller.py")]
    checks += [("sushy.pid", "sushy-emulator")]
    for vm in lab.vms:
        checks += [(os.path.basename(vm.pidfile), f"pxlab-{vm.name}"), (os.path.basename(vm.pidfile) + ".ctl", f"pxlab-{vm.name}")]
    for name, marker in checks:
        path = lab.p(name)
        pid = read_pid(path)
        if pid and pid_alive(pid) and marker in cmdline(pid) and (marker != "controller.py" or lab.path in cmdline(pid) or os.path.basename(lab.path) in cmdline(pid)):
            how = kill_pid(pid, 10 if name == "controller.pid" else 5)
            done.append(f"{name}:{pid}:{how}")
        if os.path.exists(path) and not (pid and pid_alive(pid)):
            os.unlink(path)
    ctl = read_pid(lab.p("controller.pid"))
    if not (ctl and pid_alive(ctl)) and os.path.exists(lab.p("ready")):
        os.unlink(lab.p("ready"))
    # QEMUs whose pid files are gone but which still carry this lab's names and state dir
    for pid_s in os.listdir("/proc"):
        if not pid_s.isdigit():
            continue
        c = cmdline(int(pid_s))
        if c.startswith("qemu-system") and lab.state_dir in c and any(f"pxlab-{vm.name} " in c for vm in lab.vms):
            done.append(f"stray-qemu:{pid_s}:{kill_pid(int(pid_s), 5)}")
    if not quiet or done:
        print("stopped: " + (", ".join(done) if done else "nothing was running"))


def cmd_status(args):
    lab = Lab(args.lab)
    enter_netns(lab, ["status", "--lab", args.lab])
    out = {"controller": read_pid(lab.p("controller.pid")), "sushy": read_pid(lab.p("sushy.pid")), "vms": {}}
    rf = Redfish(lab)
    for vm in lab.vms:
        pid = read_pid(vm.pidfile)
        ent = {"qemu_pid": pid if pid and pid_alive(pid) else None}
        try:
            st, d = rf.system(vm.uuid)
            if st == 200:
                ent.update(power=d.get("PowerState"), target=d.get("Boot", {}).get("BootSourceOverrideTarget"))
        except (OSError, urllib.error.URLError) as e:
            ent["redfish"] = str(e)
        out["vms"][vm.name] = ent
    print(json.dumps(out, indent=1))


def main():
    argv = sys.argv[1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="run the lab (foreground) until SIGTERM")
    s.add_argument("--lab", required=True)
    s.add_argument("--keep-state", action="store_true", help="keep sushy's state and UEFI vars of a previous run")
    for n in ("stop", "status"):
        sub.add_parser(n).add_argument("--lab", required=True)
    q = sub.add_parser("qemu-cmd", help="print the QEMU command line of a VM")
    q.add_argument("--lab", required=True)
    q.add_argument("--vm", required=True)
    q.add_argument("--boot", choices=("network", "disk"), default="disk")
    args = ap.parse_args(argv)
    if args.cmd == "start":
        cmd_start(args, argv)
    elif args.cmd == "stop":
        cmd_stop(args)
    elif args.cmd == "status":
        cmd_status(args)
    elif args.cmd == "qemu-cmd":
        lab = Lab(args.lab)
        vm = next((v for v in lab.vms if v.name == args.vm), None)
        if vm is None:
            raise SystemExit(f"no VM {args.vm}")
        print(shlex.join(netns_wrap(vm.netns, qemu_command(vm, args.boot))))


if __name__ == "__main__":
    main()
