// What llama.cpp's model loader does with a GGUF whose every tensor goes to one RPC device,
// with mmap on (its default), and nothing else:
//
//   1. connect to the RPC server (ggml_backend_rpc_init)
//   2. read the GGUF header with ggml's gguf API (no_alloc: a ggml context of tensor metadata)
//   3. map the file read-only, shared, populated, sequential advice (llama.cpp maps with
//      prefetch on: MAP_POPULATE plus POSIX_FADV_SEQUENTIAL and MADV_WILLNEED)
//   4. allocate one backend buffer on the RPC device for all the tensors, marked as weights
//   5. ggml_backend_tensor_set every tensor, in file order, from the mapping (for a tensor over
//      10 MiB ggml's RPC client first hashes it and asks the server whether it has the data
//      cached; this server has no cache, so it answers no and the data follows)
//   6. ggml_backend_synchronize
//
// ggml's RPC client sends SET_TENSOR without waiting for a reply, and its synchronize is a no-op,
// so when step 6 returns the last tensors may still be in flight (on loopback: in the socket
// buffers, or being copied by the server). Unless --no-fence is given, one round trip follows
// (read back the last byte of the last tensor): the server answers it only after it has stored
// everything sent before, so the time measured ends with every byte in the server's buffer.
// llama.cpp's loader has no such fence; its first use of the model (a graph compute) waits the
// same way.
//
// It prints the tensors and bytes sent and the load time (step 1 to 6), then exits without
// freeing the remote buffer (a loader keeps it; the server frees it when the connection closes).
// --verify reads every tensor back afterwards and compares it with the file (not timed).
//
//     rpc_upload MODEL.gguf [--endpoint 127.0.0.1:50052] [--no-fence] [--verify] [--json]

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-rpc.h"
#include "ggml.h"
#include "gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t0) {
    return std::chrono::duration<double>(clock_type::now() - t0).count();
}

void usage(const char * argv0) {
    fprintf(stderr, "usage: %s MODEL.gguf [--endpoint HOST:PORT] [--no-fence] [--verify] [--json]\n", argv0);
}

}  // namespace

int main(int argc, char ** argv) {
    std::string model;
    std::string endpoint = "127.0.0.1:50052";
    bool verify = false;
    bool json = false;
    bool fence = true;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--endpoint" && i + 1 < argc) {
            endpoint = argv[++i];
        } else if (a == "--verify") {
            verify = true;
        } else if (a == "--no-fence") {
            fence = false;
        } else if (a == "--json") {
            json = true;
        } else if (!a.empty() && a[0] != '-' && model.empty()) {
            model = a;
        } else {
            usage(argv[0]);
            return 2;
        }
    }
    if (model.empty()) {
        usage(argv[0]);
        return 2;
    }

    const auto t0 = clock_type::now();

    // 1. connect
    ggml_backend_t rpc = ggml_backend_rpc_init(endpoint.c_str(), 0);
    if (!rpc) {
        fprintf(stderr, "rpc_upload: cannot connect to the RPC server at %s\n", endpoint.c_str());
        return 1;
    }
    const double t_connect = since(t0);

    // 2. header
    ggml_context * meta = nullptr;
    gguf_init_params gp = {/*no_alloc=*/true, /*ctx=*/&meta};
    gguf_context * gguf = gguf_init_from_file(model.c_str(), gp);
    if (!gguf) {
        fprintf(stderr, "rpc_upload: %s: not a readable GGUF file\n", model.c_str());
        return 1;
    }
    const size_t data_offset = gguf_get_data_offset(gguf);
    const double t_header = since(t0);

    // 3. mapping
    int fd = open(model.c_str(), O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        fprintf(stderr, "rpc_upload: %s: %s\n", model.c_str(), strerror(errno));
        return 1;
    }
    const size_t file_size = (size_t) st.st_size;
    posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    void * map = mmap(nullptr, file_size, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (map == MAP_FAILED) {
        fprintf(stderr, "rpc_upload: mmap %s: %s\n", model.c_str(), strerror(errno));
        return 1;
    }
    posix_madvise(map, file_size, POSIX_MADV_WILLNEED);
    const uint8_t * base = (const uint8_t *) map;
    const double t_map = since(t0);

    // 4. one buffer for all tensors
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(meta, rpc);
    if (!buf) {
        fprintf(stderr, "rpc_upload: the RPC server could not allocate a buffer for the model\n");
        return 1;
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    const double t_alloc = since(t0);

    // 5. every tensor from the mapping, in file order
    const int64_t n = gguf_get_n_tensors(gguf);
    size_t sent = 0;
    int64_t count = 0;
    ggml_tensor * last = nullptr;
    for (int64_t i = 0; i < n; i++) {
        const char * name = gguf_get_tensor_name(gguf, i);
        ggml_tensor * t = ggml_get_tensor(meta, name);
        const size_t off = data_offset + gguf_get_tensor_offset(gguf, i);
        const size_t nbytes = ggml_nbytes(t);
        if (off + nbytes > file_size) {
            fprintf(stderr, "rpc_upload: %s: tensor %s runs past the end of the file\n", model.c_str(), name);
            return 1;
        }
        ggml_backend_tensor_set(t, base + off, 0, nbytes);
        sent += nbytes;
        count++;
        if (nbytes > 0) {
            last = t;
        }
    }

    // 6.
    ggml_backend_synchronize(rpc);
    if (fence && last) {
        uint8_t byte;
        ggml_backend_tensor_get(last, &byte, ggml_nbytes(last) - 1, 1);
    }
    const double t_load = since(t0);

    long mismatched = -1;
    double t_verify = 0.0;
    if (verify) {
        const auto tv = clock_type::now();
        mismatched = 0;
        std::vector<uint8_t> back;
        for (int64_t i = 0; i < n; i++) {
            ggml_tensor * t = ggml_get_tensor(meta, gguf_get_tensor_name(gguf, i));
            const size_t nbytes = ggml_nbytes(t);
            back.resize(nbytes);
            ggml_backend_tensor_get(t, back.data(), 0, nbytes);
            if (memcmp(back.data(), base + data_offset + gguf_get_tensor_offset(gguf, i), nbytes) != 0) {
                mismatched++;
            }
        }
        t_verify = since(tv);
    }

    if (json) {
        printf("{\"tensors\": %lld, \"bytes\": %zu, \"buffer_bytes\": %zu, \"seconds\": %.6f, "
               "\"connect_s\": %.6f, \"header_s\": %.6f, \"map_s\": %.6f, \"alloc_s\": %.6f, "
               "\"fenced\": %s, \"verified\": %s, \"mismatched\": %ld, \"verify_s\": %.6f}\n",
               (long long) count, sent, ggml_backend_buffer_get_size(buf), t_load, t_connect, t_header, t_map,
               t_alloc, fence && last ? "true" : "false", verify ? "true" : "false", mismatched, t_verify);
    } else {
        printf("rpc_upload: %lld tensors, %zu bytes to %s in %.3f s (%.2f GB/s); connect %.3f, header %.3f, "
               "map %.3f, alloc %.3f s%s\n",
               (long long) count, sent, endpoint.c_str(), t_load, sent / t_load / 1e9, t_connect, t_header, t_map,
               t_alloc, fence && last ? "; fenced" : "; not fenced");
        if (verify) {
            printf("rpc_upload: read back %lld tensors in %.3f s: %ld differ from the file\n", (long long) count,
                   t_verify, mismatched);
        }
    }
    fflush(stdout);
    return mismatched > 0 ? 1 : 0;
}
