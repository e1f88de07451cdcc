/*
 * NVML simulator: a LAB DOUBLE of the NVIDIA driver's libnvidia-ml.so.1. Not NVIDIA software.
 *
 * Built against NVIDIA's real nvml.h (package nvidia-nvml-dev), it exports the NVML entry points
 * that gpufleet's probe reaches through nvidia-ml-py and answers them from a hardware profile file
 * (env GPUFLEET_NVML_SIM_PROFILE, default /etc/gpufleet/nvml-sim-profile) written by
 * lab/gpufleet_lab/sim_profile.py. Any other NVML symbol is absent, so nvidia-ml-py reports
 * "Function Not Found" for it.
 *
 * Profile format: one "key value..." per line, '#' starts a comment. Node keys:
 *   driver_version 580.95.05 | nvml_version 13.580.95.05 | cuda_driver_version 13000 | device_count 8
 * "gpu <index>" starts a device; its keys:
 *   uuid S | name REST-OF-LINE | pci_bus_id S | memory_total BYTES | compute_capability MAJ MIN
 *   persistence_mode 0|1 | mig CUR PEND | ecc CUR PEND | ecc_uncorrected VOLATILE AGGREGATE
 *   remapped_rows CORR UNC PENDING FAILURE | pcie GEN_CUR GEN_MAX WIDTH_CUR WIDTH_MAX
 *   clock_event_reasons MASK | numa_node N | cpu_affinity 0-63,128-191
 *   nvlink LINK ACTIVE gpu|switch|ibmnpu|unknown|- BUS|-
 *   nvlink_errors LINK CRC_FLIT CRC_DATA REPLAY RECOVERY   (error counters of a link declared above; default 0)
 *   xids XID...           (the XIDs the GPU reported, oldest first: its history on the node)
 *   dcgm fail|skip|warn CODE  (read by the lab's dcgmi double; NVML ignores it)
 *   fabric STATE [STATUS CLIQUE CLUSTER-UUID]   (STATE: not_supported not_started in_progress completed)
 *   topology L0 L1 ...   (PCIe common ancestor per device: X PIX PXB PHB NODE SYS)
 *   unsupported FIELD...  (answer NOT_SUPPORTED: ecc ecc_errors remapped_rows mig nvlinks fabric pcie
 *                          persistence_mode compute_capability clock_event_reasons numa_node cpu_affinity
 *                          topology)
 *   lost                  (the handle query answers GPU_IS_LOST)
 * A missing profile makes nvmlInit answer DRIVER_NOT_LOADED; a malformed one UNKNOWN (reason on stderr).
 *
 * Faults at run time: the calls a monitoring loop repeats (device count, handle by index, event wait) read the
 * profile file again and apply it when its text changed, so a profile swapped on a running node (write a new file,
 * then rename it over the old one) is seen without a new nvmlInit. A missing or malformed profile then keeps the
 * previous answers (reason on stderr, once). Device handles stay valid across reloads; a device beyond
 * the new device_count answers INVALID_ARGUMENT. XIDs a reloaded profile lists beyond those the previous one
 * listed (all of them when the history was rewritten) are delivered once, as nvmlEventTypeXidCriticalError
 * events, to the event sets the GPU is registered with; XIDs in the first profile read happened before the
 * process started and are not delivered.
 */
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nvml.h"

#define SIM_MAX_GPUS 64
#define SIM_MAX_LINKS NVML_NVLINK_MAX_LINKS
#define SIM_CPU_WORDS 16 /* 1024 CPUs */
#define SIM_LINK_COUNTERS 4 /* NVML_NVLINK_ERROR_DL_REPLAY, _RECOVERY, _CRC_FLIT, _CRC_DATA (0..3) */
#define SIM_MAX_XIDS 64
#define SIM_EVENT_QUEUE 256 /* events an event set holds until waited for; more are dropped */
#define SIM_EVENT_TYPES nvmlEventTypeXidCriticalError
#define SIM_POLL_MS 50 /* how often a waiting nvmlEventSetWait looks at the profile */
#define SIM_EXPORT __attribute__((visibility("default")))

enum sim_feature {
    F_COMPUTE_CAPABILITY, F_PERSISTENCE_MODE, F_MIG, F_ECC, F_ECC_ERRORS, F_REMAPPED_ROWS, F_PCIE,
    F_CLOCK_EVENT_REASONS, F_NUMA_NODE, F_CPU_AFFINITY, F_NVLINKS, F_FABRIC, F_TOPOLOGY, F_COUNT
};

static const char *const feature_names[F_COUNT] = {
    "compute_capability", "persistence_mode", "mig", "ecc", "ecc_errors", "remapped_rows", "pcie",
    "clock_event_reasons", "numa_node", "cpu_affinity", "nvlinks", "fabric", "topology",
};

struct sim_link {
    int present, active, remote_type; /* remote_type -1: not reported */
    char remote_bus[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned long long errors[SIM_LINK_COUNTERS]; /* indexed by nvmlNvLinkErrorCounter_t */
};

struct nvmlDevice_st {
    int defined, lost;
    unsigned int index, unsupported;
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE], name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    char bus_id[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
    unsigned long long memory_total, ecc_volatile, ecc_aggregate, clock_event_reasons;
    int cc_major, cc_minor, numa_node;
    unsigned int persistence, mig_current, mig_pending, ecc_current, ecc_pending;
    unsigned int rows_correctable, rows_uncorrectable, rows_pending, rows_failure;
    unsigned int pcie_gen_current, pcie_gen_max, pcie_width_current, pcie_width_max;
    unsigned long cpus[SIM_CPU_WORDS];
    struct sim_link links[SIM_MAX_LINKS];
    int fabric_state;
    nvmlReturn_t fabric_status;
    unsigned int clique_id;
    unsigned char cluster_uuid[NVML_GPU_FABRIC_UUID_LEN];
    int topology[SIM_MAX_GPUS];
    unsigned int xids[SIM_MAX_XIDS], xid_count;
};

/* The node as a profile declares it; "staged" holds a profile being read, applied whole once it reads. */
static struct sim_state {
    int refcount;
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    char nvml_version[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE];
    int cuda_driver_version;
    unsigned int count;
    struct nvmlDevice_st dev[SIM_MAX_GPUS];
} sim, staged;

struct nvmlEventSet_st {
    struct nvmlEventSet_st *next;
    unsigned long long types[SIM_MAX_GPUS]; /* event types registered, per device */
    nvmlEventData_t queue[SIM_EVENT_QUEUE];
    unsigned int head, count;
};

static struct nvmlEventSet_st *event_sets; /* every set created and not freed */
static char *seen_text; /* the profile's text as last read, applied or not; NULL: not read, or missing */
static size_t seen_length;
static int loaded; /* a profile was applied: XIDs new in the next one are events */
static pthread_mutex_t sim_lock = PTHREAD_MUTEX_INITIALIZER; /* guards reloads and event sets */

/* ---- profile parsing ---------------------------------------------------------------------- */

static int parse_fail(const char *path, int line, const char *what, const char *text)
{
    fprintf(stderr, "nvml-sim: %s:%d: %s: %s\n", path, line, what, text);
    return -1;
}

static int copy_word(char *dst, size_t size, const char *src)
{
    if (strlen(src) + 1 > size)
        return -1;
    strcpy(dst, src);
    return 0;
}

static int topology_level(const char *label)
{
    static const struct { const char *label; int level; } levels[] = {
        {"X", NVML_TOPOLOGY_INTERNAL}, {"PIX", NVML_TOPOLOGY_SINGLE}, {"PXB", NVML_TOPOLOGY_MULTIPLE},
        {"PHB", NVML_TOPOLOGY_HOSTBRIDGE}, {"NODE", NVML_TOPOLOGY_NODE}, {"SYS", NVML_TOPOLOGY_SYSTEM},
    };
    for (size_t i = 0; i < sizeof levels / sizeof levels[0]; i++)
        if (strcmp(label, levels[i].label) == 0)
            return levels[i].level;
    return -1;
}

static int remote_type(const char *name)
{
    if (strcmp(name, "gpu") == 0) return NVML_NVLINK_DEVICE_TYPE_GPU;
    if (strcmp(name, "switch") == 0) return NVML_NVLINK_DEVICE_TYPE_SWITCH;
    if (strcmp(name, "ibmnpu") == 0) return NVML_NVLINK_DEVICE_TYPE_IBMNPU;
    if (strcmp(name, "unknown") == 0) return NVML_NVLINK_DEVICE_TYPE_UNKNOWN;
    if (strcmp(name, "-") == 0) return -1;
    return -2;
}

static int parse_cpus(struct nvmlDevice_st *d, char *list)
{
    for (char *part = strtok(list, ","); part; part = strtok(NULL, ",")) {
        unsigned int a, b;
        int n = sscanf(part, "%u-%u", &a, &b);
        if (n == 1)
            b = a;
        else if (n != 2)
            return -1;
        if (a > b || b >= SIM_CPU_WORDS * 64)
            return -1;
        for (unsigned int c = a; c <= b; c++)
            d->cpus[c / 64] |= 1UL << (c % 64);
    }
    return 0;
}

static int parse_uuid(unsigned char *out, const char *text)
{
    int n = 0;
    for (const char *p = text; *p; p++) {
        if (*p == '-')
            continue;
        if (!isxdigit((unsigned char)p[0]) || !isxdigit((unsigned char)p[1]) || n == NVML_GPU_FABRIC_UUID_LEN)
            return -1;
        char byte[3] = {p[0], p[1], 0};
        out[n++] = (unsigned char)strtoul(byte, NULL, 16);
        p++;
    }
    return n == NVML_GPU_FABRIC_UUID_LEN ? 0 : -1;
}

/* One "key rest" line of a device block; 0 on success. */
static int parse_device_line(struct nvmlDevice_st *d, const char *key, char *rest)
{
    char a[96], b[96];
    if (strcmp(key, "uuid") == 0) return copy_word(d->uuid, sizeof d->uuid, rest);
    if (strcmp(key, "name") == 0) return copy_word(d->name, sizeof d->name, rest);
    if (strcmp(key, "pci_bus_id") == 0) return copy_word(d->bus_id, sizeof d->bus_id, rest);
    if (strcmp(key, "memory_total") == 0) return sscanf(rest, "%llu", &d->memory_total) == 1 ? 0 : -1;
    if (strcmp(key, "compute_capability") == 0)
        return sscanf(rest, "%d %d", &d->cc_major, &d->cc_minor) == 2 ? 0 : -1;
    if (strcmp(key, "persistence_mode") == 0) return sscanf(rest, "%u", &d->persistence) == 1 ? 0 : -1;
    if (strcmp(key, "mig") == 0) return sscanf(rest, "%u %u", &d->mig_current, &d->mig_pending) == 2 ? 0 : -1;
    if (strcmp(key, "ecc") == 0) return sscanf(rest, "%u %u", &d->ecc_current, &d->ecc_pending) == 2 ? 0 : -1;
    if (strcmp(key, "ecc_uncorrected") == 0)
        return sscanf(rest, "%llu %llu", &d->ecc_volatile, &d->ecc_aggregate) == 2 ? 0 : -1;
    if (strcmp(key, "remapped_rows") == 0)
        return sscanf(rest, "%u %u %u %u", &d->rows_correctable, &d->rows_uncorrectable, &d->rows_pending,
                      &d->rows_failure) == 4 ? 0 : -1;
    if (strcmp(key, "pcie") == 0)
        return sscanf(rest, "%u %u %u %u", &d->pcie_gen_current, &d->pcie_gen_max, &d->pcie_width_current,
                      &d->pcie_width_max) == 4 ? 0 : -1;
    if (strcmp(key, "clock_event_reasons") == 0)
        return sscanf(rest, "%llu", &d->clock_event_reasons) == 1 ? 0 : -1;
    if (strcmp(key, "numa_node") == 0)
        return sscanf(rest, "%d", &d->numa_node) == 1 && d->numa_node >= 0 && d->numa_node < 256 ? 0 : -1;
    if (strcmp(key, "cpu_affinity") == 0) return parse_cpus(d, rest);
    if (strcmp(key, "lost") == 0) { d->lost = 1; return 0; }
    if (strcmp(key, "nvlink") == 0) {
        unsigned int link, active;
        if (sscanf(rest, "%u %u %95s %95s", &link, &active, a, b) != 4 || link >= SIM_MAX_LINKS)
            return -1;
        struct sim_link *l = &d->links[link];
        l->present = 1;
        l->active = active != 0;
        if ((l->remote_type = remote_type(a)) == -2)
            return -1;
        return strcmp(b, "-") == 0 ? 0 : copy_word(l->remote_bus, sizeof l->remote_bus, b);
    }
    if (strcmp(key, "nvlink_errors") == 0) {
        unsigned int link;
        unsigned long long flit, data, replay, recovery;
        if (sscanf(rest, "%u %llu %llu %llu %llu", &link, &flit, &data, &replay, &recovery) != 5
            || link >= SIM_MAX_LINKS || !d->links[link].present)
            return -1;
        unsigned long long *errors = d->links[link].errors;
        errors[NVML_NVLINK_ERROR_DL_CRC_FLIT] = flit;
        errors[NVML_NVLINK_ERROR_DL_CRC_DATA] = data;
        errors[NVML_NVLINK_ERROR_DL_REPLAY] = replay;
        errors[NVML_NVLINK_ERROR_DL_RECOVERY] = recovery;
        return 0;
    }
    if (strcmp(key, "dcgm") == 0) return 0; /* read by the lab's dcgmi double, not NVML */
    if (strcmp(key, "xids") == 0) {
        d->xid_count = 0;
        for (char *tok = strtok(rest, " \t"); tok; tok = strtok(NULL, " \t")) {
            char *end;
            unsigned long xid = strtoul(tok, &end, 10);
            if (*end || xid == 0 || xid > 999 || d->xid_count == SIM_MAX_XIDS)
                return -1;
            d->xids[d->xid_count++] = (unsigned int)xid;
        }
        return 0;
    }
    if (strcmp(key, "fabric") == 0) {
        static const char *const states[] = {"not_supported", "not_started", "in_progress", "completed"};
        char uuid_text[96];
        int n = sscanf(rest, "%95s %95s %u %95s", a, b, &d->clique_id, uuid_text);
        d->fabric_state = -1;
        for (int s = 0; s < 4; s++)
            if (strcmp(a, states[s]) == 0)
                d->fabric_state = s;
        if (d->fabric_state < 0 || (n != 1 && n != 4))
            return -1;
        if (n == 4) {
            d->fabric_status = strcmp(b, "success") == 0 ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
            return parse_uuid(d->cluster_uuid, uuid_text);
        }
        return 0;
    }
    if (strcmp(key, "topology") == 0) {
        unsigned int i = 0;
        for (char *tok = strtok(rest, " \t"); tok; tok = strtok(NULL, " \t")) {
            if (i >= SIM_MAX_GPUS || (d->topology[i++] = topology_level(tok)) < 0)
                return -1;
        }
        return 0;
    }
    if (strcmp(key, "unsupported") == 0) {
        for (char *tok = strtok(rest, " \t"); tok; tok = strtok(NULL, " \t")) {
            int found = 0;
            for (int f = 0; f < F_COUNT; f++)
                if (strcmp(tok, feature_names[f]) == 0) {
                    d->unsupported |= 1u << f;
                    found = 1;
                }
            if (!found)
                return -1;
        }
        return 0;
    }
    return -1;
}

static const char *profile_path(void)
{
    const char *path = getenv("GPUFLEET_NVML_SIM_PROFILE");
    return path && *path ? path : "/etc/gpufleet/nvml-sim-profile";
}

/* The whole file at path, NUL-terminated, in a malloc'd buffer; NULL with errno set when it cannot be read. */
static char *read_file(const char *path, size_t *length)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return NULL;
    size_t size = 16384, n = 0;
    char *text = malloc(size);
    for (size_t got = 1; text && got;) {
        if (n + 1 == size) {
            char *bigger = realloc(text, size *= 2);
            if (!bigger)
                free(text);
            text = bigger;
            if (!text)
                break;
        }
        n += got = fread(text + n, 1, size - n - 1, f);
    }
    int failed = ferror(f);
    fclose(f);
    if (text && failed) {
        free(text);
        text = NULL;
        errno = EIO;
    }
    if (text) {
        text[n] = 0;
        *length = n;
    }
    return text;
}

/* Copy the next line of *text into line (at most size - 1 bytes of it) and move past it; 0 at the end. */
static int next_line(const char **text, char *line, size_t size)
{
    if (!**text)
        return 0;
    size_t length = strcspn(*text, "\n"), kept = length < size - 1 ? length : size - 1;
    memcpy(line, *text, kept);
    line[kept] = 0;
    *text += length + ((*text)[length] == '\n');
    return 1;
}

/* Read the profile text (from path) into *out, all of it replaced; NVML_SUCCESS when it reads. */
static nvmlReturn_t load_profile(const char *path, const char *text, struct sim_state *out)
{
    memset(out, 0, sizeof *out);
    struct nvmlDevice_st *d = NULL;
    char line[8192];
    int lineno = 0, bad = 0;
    while (!bad && next_line(&text, line, sizeof line)) {
        lineno++;
        line[strcspn(line, "\r")] = 0;
        char *key = line + strspn(line, " \t");
        if (!*key || *key == '#')
            continue;
        char *rest = key + strcspn(key, " \t");
        if (*rest)
            *rest++ = 0;
        rest += strspn(rest, " \t");
        char original[8192];
        snprintf(original, sizeof original, "%s %s", key, rest);
        if (strcmp(key, "driver_version") == 0)
            bad = copy_word(out->driver_version, sizeof out->driver_version, rest);
        else if (strcmp(key, "nvml_version") == 0)
            bad = copy_word(out->nvml_version, sizeof out->nvml_version, rest);
        else if (strcmp(key, "cuda_driver_version") == 0)
            bad = sscanf(rest, "%d", &out->cuda_driver_version) == 1 ? 0 : -1;
        else if (strcmp(key, "device_count") == 0)
            bad = sscanf(rest, "%u", &out->count) == 1 && out->count <= SIM_MAX_GPUS ? 0 : -1;
        else if (strcmp(key, "gpu") == 0) {
            unsigned int index;
            bad = sscanf(rest, "%u", &index) == 1 && index < SIM_MAX_GPUS ? 0 : -1;
            if (!bad) {
                d = &out->dev[index];
                d->defined = 1;
                d->index = index;
                d->numa_node = -1;
            }
        } else if (d)
            bad = parse_device_line(d, key, rest);
        else
            bad = -1;
        if (bad)
            parse_fail(path, lineno, "cannot read", original);
    }
    for (unsigned int i = 0; !bad && i < out->count; i++)
        if (!out->dev[i].defined)
            bad = parse_fail(path, 0, "no gpu block for device", "index below device_count");
    return bad ? NVML_ERROR_UNKNOWN : NVML_SUCCESS;
}

/* ---- reloading at run time, XID events ------------------------------------------------------ */

/* Queue XID xid of device index on every event set registered for XID events there (caller holds sim_lock). */
static void deliver_xid(unsigned int index, unsigned int xid)
{
    for (struct nvmlEventSet_st *set = event_sets; set; set = set->next) {
        if (!(set->types[index] & nvmlEventTypeXidCriticalError) || set->count == SIM_EVENT_QUEUE)
            continue;
        nvmlEventData_t *event = &set->queue[(set->head + set->count++) % SIM_EVENT_QUEUE];
        memset(event, 0, sizeof *event);
        event->device = &sim.dev[index];
        event->eventType = nvmlEventTypeXidCriticalError;
        event->eventData = xid;
        event->gpuInstanceId = event->computeInstanceId = 0xFFFFFFFFu;
    }
}

/* Make the staged profile the node's state; XIDs it lists beyond the previous profile's are delivered. */
static void apply_staged(void)
{
    for (unsigned int i = 0; loaded && i < SIM_MAX_GPUS; i++) {
        const struct nvmlDevice_st *before = &sim.dev[i], *after = &staged.dev[i];
        int kept = before->xid_count <= after->xid_count
                   && memcmp(before->xids, after->xids, before->xid_count * sizeof before->xids[0]) == 0;
        for (unsigned int x = kept ? before->xid_count : 0; x < after->xid_count; x++)
            deliver_xid(i, after->xids[x]);
    }
    staged.refcount = sim.refcount;
    sim = staged;
    loaded = 1;
}

/* Apply the profile if its text changed since it was last read (always with force); a profile that cannot be
 * read leaves the state as it was, and says why once. Caller holds sim_lock. */
static nvmlReturn_t reload(int force)
{
    const char *path = profile_path();
    size_t length = 0;
    char *text = read_file(path, &length);
    if (!text) {
        if (force || seen_text)
            fprintf(stderr, "nvml-sim: cannot open profile %s: %s\n", path, strerror(errno));
        free(seen_text);
        seen_text = NULL;
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    if (!force && seen_text && length == seen_length && memcmp(text, seen_text, length) == 0) {
        free(text);
        return NVML_SUCCESS;
    }
    free(seen_text);
    seen_text = text;
    seen_length = length;
    nvmlReturn_t r = load_profile(path, text, &staged);
    if (r == NVML_SUCCESS)
        apply_staged();
    return r;
}

static void reload_if_changed(void)
{
    pthread_mutex_lock(&sim_lock);
    reload(0);
    pthread_mutex_unlock(&sim_lock);
}

/* ---- helpers ------------------------------------------------------------------------------- */

static nvmlReturn_t check_device(nvmlDevice_t d)
{
    if (sim.refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (!d || d < sim.dev || d >= sim.dev + sim.count)
        return NVML_ERROR_INVALID_ARGUMENT;
    return d->lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
}

#define DEVICE(d, ...)                                                                         \
    do {                                                                                       \
        nvmlReturn_t r_ = check_device(d);                                                     \
        if (r_ != NVML_SUCCESS)                                                                \
            return r_;                                                                         \
        void *args_[] = {__VA_ARGS__};                                                         \
        for (size_t i_ = 0; i_ < sizeof args_ / sizeof args_[0]; i_++)                         \
            if (!args_[i_])                                                                    \
                return NVML_ERROR_INVALID_ARGUMENT;                                            \
    } while (0)

#define FEATURE(d, f)                                                                          \
    do {                                                                                       \
        if ((d)->unsupported & (1u << (f)))                                                    \
            return NVML_ERROR_NOT_SUPPORTED;                                                   \
    } while (0)

static nvmlReturn_t copy_out(char *dst, unsigned int length, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

static void fill_pci(nvmlPciInfo_t *pci, const char *bus_id)
{
    unsigned int domain = 0, bus = 0, device = 0;
    memset(pci, 0, sizeof *pci);
    sscanf(bus_id, "%x:%x:%x", &domain, &bus, &device);
    pci->domain = domain;
    pci->bus = bus;
    pci->device = device;
    pci->pciDeviceId = 0x10DE; /* vendor NVIDIA; the device id is not simulated */
    snprintf(pci->busId, sizeof pci->busId, "%s", bus_id);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", domain & 0xFFFF, bus, device);
}

/* ---- initialisation and system queries ----------------------------------------------------- */

SIM_EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&sim_lock);
    nvmlReturn_t r = reload(sim.refcount == 0);
    if (r == NVML_SUCCESS || sim.refcount > 0) {
        sim.refcount++;
        r = NVML_SUCCESS;
    }
    pthread_mutex_unlock(&sim_lock);
    return r;
}

SIM_EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
SIM_EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

SIM_EXPORT nvmlReturn_t nvmlShutdown(void)
{
    if (sim.refcount == 0)
        return NVML_ERROR_UNINITIALIZED;
    sim.refcount--;
    return NVML_SUCCESS;
}

SIM_EXPORT const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    return sim.refcount ? copy_out(version, length, sim.driver_version) : NVML_ERROR_UNINITIALIZED;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    return sim.refcount ? copy_out(version, length, sim.nvml_version) : NVML_ERROR_UNINITIALIZED;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    if (!sim.refcount)
        return NVML_ERROR_UNINITIALIZED;
    if (!cudaDriverVersion)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = sim.cuda_driver_version;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    if (!sim.refcount)
        return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount)
        return NVML_ERROR_INVALID_ARGUMENT;
    reload_if_changed();
    *deviceCount = sim.count;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount) { return nvmlDeviceGetCount_v2(deviceCount); }

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!sim.refcount)
        return NVML_ERROR_UNINITIALIZED;
    reload_if_changed();
    if (!device || index >= sim.count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (sim.dev[index].lost)
        return NVML_ERROR_GPU_IS_LOST;
    *device = &sim.dev[index];
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

/* ---- device identity ------------------------------------------------------------------------ */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    DEVICE(device, index);
    *index = device->index;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    DEVICE(device, uuid);
    return copy_out(uuid, length, device->uuid);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    DEVICE(device, name);
    return copy_out(name, length, device->name);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci)
{
    DEVICE(device, pci);
    fill_pci(pci, device->bus_id);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    DEVICE(device, memory);
    memory->total = device->memory_total;
    memory->free = device->memory_total;
    memory->used = 0;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    DEVICE(device, memory);
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = device->memory_total;
    memory->reserved = 0;
    memory->free = device->memory_total;
    memory->used = 0;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor)
{
    DEVICE(device, major, minor);
    FEATURE(device, F_COMPUTE_CAPABILITY);
    *major = device->cc_major;
    *minor = device->cc_minor;
    return NVML_SUCCESS;
}

/* ---- modes and reliability ------------------------------------------------------------------ */

SIM_EXPORT nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, nvmlEnableState_t *mode)
{
    DEVICE(device, mode);
    FEATURE(device, F_PERSISTENCE_MODE);
    *mode = device->persistence ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode)
{
    DEVICE(device, currentMode, pendingMode);
    FEATURE(device, F_MIG);
    *currentMode = device->mig_current;
    *pendingMode = device->mig_pending;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t device, nvmlEnableState_t *current, nvmlEnableState_t *pending)
{
    DEVICE(device, current, pending);
    FEATURE(device, F_ECC);
    *current = device->ecc_current ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    *pending = device->ecc_pending ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                                    nvmlEccCounterType_t counterType, unsigned long long *eccCounts)
{
    DEVICE(device, eccCounts);
    FEATURE(device, F_ECC);
    FEATURE(device, F_ECC_ERRORS);
    if (counterType != NVML_VOLATILE_ECC && counterType != NVML_AGGREGATE_ECC)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (errorType == NVML_MEMORY_ERROR_TYPE_CORRECTED)
        *eccCounts = 0;
    else if (errorType == NVML_MEMORY_ERROR_TYPE_UNCORRECTED)
        *eccCounts = counterType == NVML_VOLATILE_ECC ? device->ecc_volatile : device->ecc_aggregate;
    else
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows, unsigned int *uncRows,
                                                  unsigned int *isPending, unsigned int *failureOccurred)
{
    DEVICE(device, corrRows, uncRows, isPending, failureOccurred);
    FEATURE(device, F_REMAPPED_ROWS);
    *corrRows = device->rows_correctable;
    *uncRows = device->rows_uncorrectable;
    *isPending = device->rows_pending;
    *failureOccurred = device->rows_failure;
    return NVML_SUCCESS;
}

/* ---- PCIe, clocks, affinity ----------------------------------------------------------------- */

#define PCIE_QUERY(fn, field)                                                                  \
    SIM_EXPORT nvmlReturn_t fn(nvmlDevice_t device, unsigned int *value)                      \
    {                                                                                          \
        DEVICE(device, value);                                                                 \
        FEATURE(device, F_PCIE);                                                               \
        *value = device->field;                                                                \
        return NVML_SUCCESS;                                                                   \
    }

PCIE_QUERY(nvmlDeviceGetCurrPcieLinkGeneration, pcie_gen_current)
PCIE_QUERY(nvmlDeviceGetMaxPcieLinkGeneration, pcie_gen_max)
PCIE_QUERY(nvmlDeviceGetGpuMaxPcieLinkGeneration, pcie_gen_max)
PCIE_QUERY(nvmlDeviceGetCurrPcieLinkWidth, pcie_width_current)
PCIE_QUERY(nvmlDeviceGetMaxPcieLinkWidth, pcie_width_max)

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    DEVICE(device, reasons);
    FEATURE(device, F_CLOCK_EVENT_REASONS);
    *reasons = device->clock_event_reasons;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons)
{
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetMemoryAffinity(nvmlDevice_t device, unsigned int nodeSetSize,
                                                    unsigned long *nodeSet, nvmlAffinityScope_t scope)
{
    DEVICE(device, nodeSet);
    FEATURE(device, F_NUMA_NODE);
    if (scope != NVML_AFFINITY_SCOPE_NODE && scope != NVML_AFFINITY_SCOPE_SOCKET)
        return NVML_ERROR_INVALID_ARGUMENT;
    memset(nodeSet, 0, nodeSetSize * sizeof *nodeSet);
    if (device->numa_node >= 0 && (unsigned int)device->numa_node / 64 < nodeSetSize)
        nodeSet[device->numa_node / 64] = 1UL << (device->numa_node % 64);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinityWithinScope(nvmlDevice_t device, unsigned int cpuSetSize,
                                                            unsigned long *cpuSet, nvmlAffinityScope_t scope)
{
    DEVICE(device, cpuSet);
    FEATURE(device, F_CPU_AFFINITY);
    if (scope != NVML_AFFINITY_SCOPE_NODE && scope != NVML_AFFINITY_SCOPE_SOCKET)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int w = 0; w < cpuSetSize; w++)
        cpuSet[w] = w < SIM_CPU_WORDS ? device->cpus[w] : 0;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetCpuAffinity(nvmlDevice_t device, unsigned int cpuSetSize, unsigned long *cpuSet)
{
    return nvmlDeviceGetCpuAffinityWithinScope(device, cpuSetSize, cpuSet, NVML_AFFINITY_SCOPE_NODE);
}

/* ---- NVLink, fabric, topology --------------------------------------------------------------- */

static nvmlReturn_t find_link(nvmlDevice_t device, unsigned int link, struct sim_link **out)
{
    FEATURE(device, F_NVLINKS);
    if (link >= SIM_MAX_LINKS || !device->links[link].present)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = &device->links[link];
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, nvmlEnableState_t *isActive)
{
    struct sim_link *l;
    DEVICE(device, isActive);
    nvmlReturn_t r = find_link(device, link, &l);
    if (r == NVML_SUCCESS)
        *isActive = l->active ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    return r;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo_v2(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    struct sim_link *l;
    DEVICE(device, pci);
    nvmlReturn_t r = find_link(device, link, &l);
    if (r != NVML_SUCCESS)
        return r;
    if (!l->remote_bus[0])
        return NVML_ERROR_NOT_SUPPORTED;
    fill_pci(pci, l->remote_bus);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemotePciInfo(nvmlDevice_t device, unsigned int link, nvmlPciInfo_t *pci)
{
    return nvmlDeviceGetNvLinkRemotePciInfo_v2(device, link, pci);
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkRemoteDeviceType(nvmlDevice_t device, unsigned int link,
                                                            nvmlIntNvLinkDeviceType_t *pNvLinkDeviceType)
{
    struct sim_link *l;
    DEVICE(device, pNvLinkDeviceType);
    nvmlReturn_t r = find_link(device, link, &l);
    if (r != NVML_SUCCESS)
        return r;
    if (l->remote_type < 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *pNvLinkDeviceType = (nvmlIntNvLinkDeviceType_t)l->remote_type;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link,
                                                        nvmlNvLinkErrorCounter_t counter, unsigned long long *value)
{
    struct sim_link *l;
    DEVICE(device, value);
    nvmlReturn_t r = find_link(device, link, &l);
    if (r != NVML_SUCCESS)
        return r;
    if ((unsigned int)counter >= SIM_LINK_COUNTERS) /* the ECC counter of NVLink 4 is not simulated */
        return counter == NVML_NVLINK_ERROR_DL_ECC_DATA ? NVML_ERROR_NOT_SUPPORTED : NVML_ERROR_INVALID_ARGUMENT;
    *value = l->errors[counter];
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t device, nvmlGpuFabricInfo_t *info)
{
    DEVICE(device, info);
    FEATURE(device, F_FABRIC);
    memset(info, 0, sizeof *info);
    info->state = (nvmlGpuFabricState_t)device->fabric_state;
    info->status = device->fabric_status;
    info->cliqueId = device->clique_id;
    memcpy(info->clusterUuid, device->cluster_uuid, sizeof info->clusterUuid);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t device, nvmlGpuFabricInfoV_t *info)
{
    DEVICE(device, info);
    unsigned int version = info->version;
    if (version != nvmlGpuFabricInfo_v2 && version != nvmlGpuFabricInfo_v3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    FEATURE(device, F_FABRIC);
    /* v2 is v3 without the trailing healthSummary byte: write only what the caller's size holds. */
    nvmlGpuFabricInfo_v3_t full;
    memset(&full, 0, sizeof full);
    full.version = version;
    full.state = (nvmlGpuFabricState_t)device->fabric_state;
    full.status = device->fabric_status;
    full.cliqueId = device->clique_id;
    memcpy(full.clusterUuid, device->cluster_uuid, sizeof full.clusterUuid);
    full.healthSummary = NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY;
    memcpy(info, &full, version == nvmlGpuFabricInfo_v2 ? sizeof(nvmlGpuFabricInfo_v2_t) : sizeof full);
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t device1, nvmlDevice_t device2,
                                                            nvmlGpuTopologyLevel_t *pathInfo)
{
    DEVICE(device1, pathInfo);
    DEVICE(device2, pathInfo);
    FEATURE(device1, F_TOPOLOGY);
    *pathInfo = (nvmlGpuTopologyLevel_t)device1->topology[device2->index];
    return NVML_SUCCESS;
}

/* ---- events: XIDs from the profile's history (see the top of this file) ----------------------- */

static int known_set(nvmlEventSet_t set)
{
    for (struct nvmlEventSet_st *s = event_sets; s; s = s->next)
        if (s == set)
            return 1;
    return 0;
}

SIM_EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    if (!sim.refcount)
        return NVML_ERROR_UNINITIALIZED;
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct nvmlEventSet_st *created = calloc(1, sizeof *created);
    if (!created)
        return NVML_ERROR_MEMORY;
    pthread_mutex_lock(&sim_lock);
    created->next = event_sets;
    event_sets = created;
    pthread_mutex_unlock(&sim_lock);
    *set = created;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    DEVICE(device, eventTypes);
    *eventTypes = SIM_EVENT_TYPES;
    return NVML_SUCCESS;
}

SIM_EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes, nvmlEventSet_t set)
{
    DEVICE(device, set);
    if (eventTypes & ~(unsigned long long)SIM_EVENT_TYPES)
        return NVML_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&sim_lock);
    nvmlReturn_t r = known_set(set) ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    if (r == NVML_SUCCESS)
        set->types[device - sim.dev] |= eventTypes;
    pthread_mutex_unlock(&sim_lock);
    return r;
}

static long elapsed_ms(const struct timespec *since)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000 + (now.tv_nsec - since->tv_nsec) / 1000000;
}

SIM_EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    if (!sim.refcount)
        return NVML_ERROR_UNINITIALIZED;
    if (!set || !data)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        pthread_mutex_lock(&sim_lock);
        nvmlReturn_t r = known_set(set) ? NVML_ERROR_TIMEOUT : NVML_ERROR_INVALID_ARGUMENT;
        if (r == NVML_ERROR_TIMEOUT) {
            reload(0);
            if (set->count) {
                *data = set->queue[set->head];
                set->head = (set->head + 1) % SIM_EVENT_QUEUE;
                set->count--;
                r = NVML_SUCCESS;
            }
        }
        pthread_mutex_unlock(&sim_lock);
        long left = (long)timeoutms - elapsed_ms(&start);
        if (r != NVML_ERROR_TIMEOUT || left <= 0)
            return r;
        long nap = left < SIM_POLL_MS ? left : SIM_POLL_MS;
        struct timespec pause = {nap / 1000, (nap % 1000) * 1000000L};
        nanosleep(&pause, NULL);
    }
}

SIM_EXPORT nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return nvmlEventSetWait_v2(set, data, timeoutms);
}

SIM_EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    if (!sim.refcount)
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t r = NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&sim_lock);
    for (struct nvmlEventSet_st **link = &event_sets; *link; link = &(*link)->next)
        if (*link == set) {
            *link = set->next;
            free(set);
            r = NVML_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&sim_lock);
    return r;
}
