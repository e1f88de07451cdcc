"""Lab doubles of NVIDIA's packages: minimal .debs with the names and versions of NVIDIA's CUDA apt repository.

Lab nodes have no GPU, so the real driver, fabric manager and DCGM cannot run there. These packages let the
roles run unchanged against the lab: the same ``apt-get install`` of the same pinned names and versions from a
signed repository (:mod:`gpufleet_lab.mirror`), the same systemd units and ports. Every package says it is a lab
double in its Description and installs a ``/usr/share/doc/<package>/LAB-DOUBLE`` note. The programs they ship
are in :mod:`gpufleet_lab.double_programs`; GPU data comes from the node's simulated NVML (installed separately: the
driver doubles depend on ``libnvidia-compute-<branch>``, whose ``libnvidia-ml.so.1`` is the simulator: a node
has NVML only once the driver is installed, as a real one).

Builds are reproducible (fixed timestamps), so rebuilding leaves unchanged packages byte-identical.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet_lab.errors import LabError
from gpufleet_lab.nvml_sim import LIBRARY_NAME, build_library, library_dir
from gpufleet_lab.state import cache_dir

DRIVER_BRANCH = 580
DRIVER_VERSION = "580.95.05-1"
DCGM_VERSION = "1:4.4.1-1"
DCGM_EXPORTER_VERSION = "4.4.1-4.6.0-1"
CUDA_MAJOR = 13
CUDA_MINOR = 0
CUDA_TOOLKIT_VERSION = "13.0.2-1"  # cuda-toolkit-13-0 of CUDA 13.0 Update 2, the release of driver 580.95.05
MAINTAINER = "gpufleet lab <lab@gpufleet.invalid>"
EPOCH = 1700000000  # fixed mtime of every packaged file (reproducible builds)
PROGRAMS_DIR = Path(__file__).with_name("double_programs")
EXPORTER_LIB = "/usr/lib/gpufleet-lab/dcgm-exporter"


@dataclass(frozen=True)
class LabDouble:
    """One lab-double package: control fields, files (path -> (content, mode)) and the units it ships."""

    name: str
    version: str
    doubles: str  # what of NVIDIA's it stands in for, for the Description
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    depends: str = ""
    conflicts: str = ""
    provides: str = ""
    units: tuple[str, ...] = ()
    architecture: str = "amd64"
    triggers: tuple[str, ...] = ()  # dpkg triggers it activates (``ldconfig`` for a shared library)

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version.split(':')[-1]}_{self.architecture}.deb"

    def control(self, installed_kib: int) -> str:
        fields = {
            "Package": self.name,
            "Version": self.version,
            "Architecture": self.architecture,
            "Maintainer": MAINTAINER,
            "Installed-Size": str(installed_kib),
            "Depends": self.depends,
            "Conflicts": self.conflicts,
            "Provides": self.provides,
            "Section": "non-free/misc",
            "Priority": "optional",
            "Description": f"LAB DOUBLE of {self.doubles} (gpufleet lab, not NVIDIA software)\n"
            " A stand-in built by gpufleet for its lab nodes, which have no GPU. It carries the name and\n"
            " version of NVIDIA's package so deployments run unchanged; it contains none of NVIDIA's code.",
        }
        return "".join(f"{k}: {v}\n" for k, v in fields.items() if v)


def lab_doubles(driver_version: str = DRIVER_VERSION, branch: int = DRIVER_BRANCH,
                nvml_library: bytes | None = None) -> list[LabDouble]:
    """The packages of the lab's NVIDIA repository: driver branch ``branch`` with its NVML library (the simulator,
    built here unless ``nvml_library`` gives its bytes), fabric manager, DCGM 4, exporter, CUDA toolkit."""
    same_driver = f"(= {driver_version})"
    compute = f"libnvidia-compute-{branch} {same_driver}"
    library = nvml_library if nvml_library is not None else _nvml_library()
    fm_cfg = b"# gpufleet LAB DOUBLE: fabric manager configuration (read by nobody)\nLOG_LEVEL=4\nFABRIC_MODE=0\n"
    pinning = (
        f"# gpufleet LAB DOUBLE of NVIDIA's driver pinning package: keeps the driver on branch {branch}.\n"
        f"Package: nvidia-driver-{branch}-open nvidia-driver-{branch} cuda-drivers-{branch} "
        f"nvidia-fabricmanager-{branch} nvidia-persistenced\n"
        f"Pin: version {branch}.*\nPin-Priority: 1000\n"
    ).encode()
    return [
        LabDouble(
            f"nvidia-driver-{branch}-open", driver_version, f"the NVIDIA {branch} driver (open kernel modules)",
            depends=compute, conflicts=f"nvidia-driver-{branch}",
        ),
        LabDouble(
            f"nvidia-driver-{branch}", driver_version, f"the NVIDIA {branch} driver (proprietary kernel modules)",
            depends=compute, conflicts=f"nvidia-driver-{branch}-open",
        ),
        LabDouble(
            f"libnvidia-compute-{branch}", driver_version, f"NVIDIA's {branch} compute libraries (NVML: the simulator)",
            files={f"/{library_dir()}/{LIBRARY_NAME}": (library, 0o644)}, triggers=("activate-noawait ldconfig",),
        ),
        LabDouble(
            f"cuda-drivers-{branch}", driver_version, f"NVIDIA's cuda-drivers-{branch} metapackage",
            depends=f"nvidia-driver-{branch}-open {same_driver} | nvidia-driver-{branch} {same_driver}",
        ),
        LabDouble(
            f"nvidia-driver-pinning-{branch}", driver_version, f"NVIDIA's driver branch {branch} pinning package",
            files={f"/etc/apt/preferences.d/nvidia-driver-pinning-{branch}": (pinning, 0o644)},
            architecture="all",
        ),
        LabDouble(
            f"nvidia-fabricmanager-{branch}", driver_version, "NVIDIA Fabric Manager (NVSwitch systems)",
            depends="python3",
            provides=f"nvidia-fabricmanager {same_driver}",
            files={
                "/usr/bin/nv-fabricmanager": (_program("idle_daemon.py"), 0o755),
                "/usr/share/nvidia/nvswitch/fabricmanager.cfg": (fm_cfg, 0o644),
                "/lib/systemd/system/nvidia-fabricmanager.service": (_unit(
                    "NVIDIA fabric manager (gpufleet lab double)",
                    "/usr/bin/nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg",
                ), 0o644),
            },
            units=("nvidia-fabricmanager.service",),
        ),
        LabDouble(
            "nvidia-persistenced", driver_version, "the NVIDIA persistence daemon",
            depends="python3",
            files={
                "/usr/bin/nvidia-persistenced": (_program("idle_daemon.py"), 0o755),
                "/lib/systemd/system/nvidia-persistenced.service": (_unit(
                    "NVIDIA persistence daemon (gpufleet lab double)", "/usr/bin/nvidia-persistenced --verbose",
                ), 0o644),
            },
            units=("nvidia-persistenced.service",),
        ),
        LabDouble("datacenter-gpu-manager-4-core", DCGM_VERSION, "NVIDIA DCGM 4 (core: dcgmi)",
                  depends="python3", files={"/usr/bin/dcgmi": (_program("dcgmi.py"), 0o755)}),
        LabDouble(
            f"datacenter-gpu-manager-4-cuda{CUDA_MAJOR}", DCGM_VERSION,
            f"NVIDIA DCGM 4 for CUDA {CUDA_MAJOR} (host engine nv-hostengine)",
            depends=f"datacenter-gpu-manager-4-core (= {DCGM_VERSION}), python3",
            files={
                "/usr/bin/nv-hostengine": (_program("nv_hostengine.py"), 0o755),
                "/lib/systemd/system/nvidia-dcgm.service": (_unit(
                    "NVIDIA DCGM host engine (gpufleet lab double)", "/usr/bin/nv-hostengine -n -b 127.0.0.1 -p 5555",
                ), 0o644),
            },
            units=("nvidia-dcgm.service",),
        ),
        LabDouble(
            "datacenter-gpu-manager-exporter", DCGM_EXPORTER_VERSION, "NVIDIA dcgm-exporter",
            depends="python3, datacenter-gpu-manager-4-core",
            files={
                "/usr/bin/dcgm-exporter": (_program("dcgm_exporter.py"), 0o755),
                f"{EXPORTER_LIB}/pynvml.py": (_bundled_pynvml(), 0o644),
                "/etc/dcgm-exporter/default-counters.csv": (DEFAULT_COUNTERS.encode(), 0o644),
            },
        ),
        cuda_toolkit_double(),
    ]


def cuda_toolkit_double(major: int = CUDA_MAJOR, minor: int = CUDA_MINOR,
                        version: str = CUDA_TOOLKIT_VERSION) -> LabDouble:
    """``cuda-toolkit-<major>-<minor>``: NVIDIA's layout in ``/usr/local/cuda-<major>.<minor>`` (``bin/nvcc``,
    ``include/``, ``lib64/``), whose ``nvcc --version`` answers as NVIDIA's does and which compiles nothing."""
    home = f"/usr/local/cuda-{major}.{minor}"
    nvcc = (
        "#!/bin/sh\n"
        "# gpufleet LAB DOUBLE of NVIDIA's nvcc: it reports its version and compiles nothing.\n"
        'case "$1" in --version|-V)\n'
        "  echo 'nvcc: gpufleet LAB DOUBLE of the NVIDIA CUDA compiler driver (not NVIDIA software)'\n"
        f"  echo 'Cuda compilation tools, release {major}.{minor}, V{version.split('-')[0]}'\n"
        "  exit 0;;\n"
        "esac\n"
        "echo 'nvcc: gpufleet LAB DOUBLE: lab nodes have no GPU, and this nvcc compiles nothing' >&2\n"
        "exit 1\n"
    ).encode()
    empty = f"gpufleet LAB DOUBLE: where NVIDIA's CUDA {major}.{minor} toolkit has its files; none here.\n".encode()
    return LabDouble(
        f"cuda-toolkit-{major}-{minor}", version, f"NVIDIA's CUDA toolkit {major}.{minor} (nvcc)",
        files={f"{home}/bin/nvcc": (nvcc, 0o755), f"{home}/include/LAB-DOUBLE": (empty, 0o644),
               f"{home}/lib64/LAB-DOUBLE": (empty, 0o644)},
    )


def _nvml_library() -> bytes:
    try:
        return build_library(cache_dir() / "nvml-sim").read_bytes()
    except Exception as exc:  # the simulator's own errors carry the compiler's message
        first = str(exc).strip().splitlines()[:1] or [type(exc).__name__]
        raise LabError(f"cannot build the simulated NVML library: {first[0]}") from exc


def build_debs(out_dir: Path | str, doubles: list[LabDouble] | None = None) -> list[Path]:
    """Build every lab double into ``out_dir`` with ``dpkg-deb`` (root-owned files) and return the .deb paths.

    A package whose bytes did not change is left untouched. Raises :class:`LabError` when dpkg-deb fails.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    built = []
    for double in doubles if doubles is not None else lab_doubles():
        target = out / double.filename
        with tempfile.TemporaryDirectory(dir=out, prefix=".build-") as tmp:
            fresh = _build_one(double, Path(tmp))
            if not target.exists() or target.read_bytes() != fresh.read_bytes():
                os.replace(fresh, target)
        built.append(target)
    return built


def _build_one(double: LabDouble, tmp: Path) -> Path:
    root = tmp / "root"
    files = {
        f"/usr/share/doc/{double.name}/LAB-DOUBLE": (
            f"{double.name} {double.version}: a gpufleet LAB DOUBLE of {double.doubles}.\n"
            "It exists so deployments run unchanged on the gpufleet lab, whose nodes have no GPU.\n"
            "It contains none of NVIDIA's software.\n".encode(),
            0o644,
        ),
        **double.files,
    }
    for path, (content, mode) in files.items():
        dest = root / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(content)
        dest.chmod(mode)
    debian = root / "DEBIAN"
    debian.mkdir()
    installed_kib = sum((len(c) + 1023) // 1024 for c, _ in files.values())
    (debian / "control").write_text(double.control(installed_kib))
    if double.triggers:
        (debian / "triggers").write_text("".join(f"{t}\n" for t in double.triggers))
    conffiles = [p for p in files if p.startswith("/etc/")]
    if conffiles:
        (debian / "conffiles").write_text("".join(f"{p}\n" for p in conffiles))
    if double.units:
        for script, text in _maintainer_scripts(double.units).items():
            (debian / script).write_text(text)
            (debian / script).chmod(0o755)
    for entry in sorted(root.rglob("*"), reverse=True):
        if entry.is_dir():
            entry.chmod(0o755)
        os.utime(entry, (EPOCH, EPOCH), follow_symlinks=False)
    os.utime(root, (EPOCH, EPOCH))
    deb = tmp / double.filename
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(EPOCH))
    proc = subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(root), str(deb)],
        capture_output=True, text=True, env=env,
    )
    if proc.returncode != 0:
        raise LabError(f"dpkg-deb could not build {double.name}: {proc.stderr.strip()}")
    return deb


def _maintainer_scripts(units: tuple[str, ...]) -> dict[str, str]:
    """Minimal scripts: systemd learns about the units; enabling and starting them is the deployment's job."""
    reload = "if [ -d /run/systemd/system ]; then systemctl daemon-reload || true; fi\n"
    stop = "".join(f"  systemctl stop {u} || true\n" for u in units)
    return {
        "postinst": f"#!/bin/sh\nset -e\n{reload}",
        "prerm": f'#!/bin/sh\nset -e\nif [ "$1" = remove ] && [ -d /run/systemd/system ]; then\n{stop}fi\n',
        "postrm": f"#!/bin/sh\nset -e\n{reload}",
    }


def _unit(description: str, exec_start: str) -> bytes:
    return (
        f"# gpufleet LAB DOUBLE of NVIDIA's unit: same name, a stand-in program.\n"
        f"[Unit]\nDescription={description}\n\n"
        f"[Service]\nType=simple\nExecStart={exec_start}\nRestart=on-failure\n\n"
        f"[Install]\nWantedBy=multi-user.target\n"
    ).encode()


def _program(name: str) -> bytes:
    return (PROGRAMS_DIR / name).read_bytes()


def _bundled_pynvml() -> bytes:
    """The pure-Python pynvml of the controller's nvidia-ml-py, shipped so the exporter double needs no pip."""
    spec = importlib.util.find_spec("pynvml")
    if spec is None or spec.origin is None:
        raise LabError("nvidia-ml-py (module pynvml) is not installed on the controller; pip install nvidia-ml-py")
    return Path(spec.origin).read_bytes()


DEFAULT_COUNTERS = """\
# gpufleet LAB DOUBLE of dcgm-exporter's default counters: DCGM field, Prometheus type, help text.
# Like NVIDIA's defaults, error counters (ECC, NVLink, violations) are commented out: enable them in the
# counters file the deployment installs.

DCGM_FI_DEV_SM_CLOCK, gauge, SM clock frequency (in MHz).
DCGM_FI_DEV_MEM_CLOCK, gauge, Memory clock frequency (in MHz).
DCGM_FI_DEV_GPU_TEMP, gauge, GPU temperature (in C).
DCGM_FI_DEV_MEMORY_TEMP, gauge, Memory temperature (in C).
DCGM_FI_DEV_POWER_USAGE, gauge, Power draw (in W).
DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, counter, Total energy consumption since boot (in mJ).
DCGM_FI_DEV_PCIE_REPLAY_COUNTER, counter, Total number of PCIe retries.
DCGM_FI_DEV_GPU_UTIL, gauge, GPU utilization (in %).
DCGM_FI_DEV_MEM_COPY_UTIL, gauge, Memory utilization (in %).
DCGM_FI_DEV_ENC_UTIL, gauge, Encoder utilization (in %).
DCGM_FI_DEV_DEC_UTIL, gauge, Decoder utilization (in %).
DCGM_FI_DEV_XID_ERRORS, gauge, Value of the last XID error seen.
DCGM_FI_DEV_FB_FREE, gauge, Framebuffer memory free (in MiB).
DCGM_FI_DEV_FB_USED, gauge, Framebuffer memory used (in MiB).
DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS, counter, Rows remapped for correctable errors.
DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS, counter, Rows remapped for uncorrectable errors.
DCGM_FI_DEV_ROW_REMAP_FAILURE, gauge, Whether a row remapping has failed.
# DCGM_FI_DEV_ROW_REMAP_PENDING, gauge, Whether a row remapping waits for a GPU reset.
# DCGM_FI_DEV_ECC_SBE_VOL_TOTAL, counter, Single-bit volatile ECC errors.
# DCGM_FI_DEV_ECC_DBE_VOL_TOTAL, counter, Double-bit volatile ECC errors.
# DCGM_FI_DEV_ECC_SBE_AGG_TOTAL, counter, Single-bit persistent ECC errors.
# DCGM_FI_DEV_ECC_DBE_AGG_TOTAL, counter, Double-bit persistent ECC errors.
# DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL, counter, NVLink flow-control CRC errors, all links.
# DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL, counter, NVLink data CRC errors, all links.
# DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL, counter, NVLink retries, all links.
# DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL, counter, NVLink recoveries, all links.
# DCGM_FI_DEV_POWER_VIOLATION, counter, Time throttled by the power limit (in us).
# DCGM_FI_DEV_THERMAL_VIOLATION, counter, Time throttled by temperature (in us).
# DCGM_FI_DRIVER_VERSION, label, Driver version.
"""
