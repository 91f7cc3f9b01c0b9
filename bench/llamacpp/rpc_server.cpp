// An equivalent of llama.cpp's rpc-server for a CPU-only build: ggml's RPC server on the CPU
// backend, listening on HOST:PORT, no local cache. It makes the same call llama.cpp's
// tools/rpc/rpc-server makes (ggml_backend_rpc_start_server with the CPU device, half the
// hardware threads, cache_dir = NULL), and prints one ready line once the socket is listening:
//
//     rpc_server: listening on 127.0.0.1:50052
//
// ggml's server prints nothing after listen(), and connecting to probe it would use up one of
// its (serial) client sessions, so a watcher thread looks for our own listening socket in
// /proc/net/tcp instead.
//
//     rpc_server [--host 127.0.0.1] [--port 50052] [--threads N]

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-rpc.h"

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>

namespace {

// Socket inodes of this process's open descriptors.
std::set<unsigned long> own_socket_inodes() {
    std::set<unsigned long> inodes;
    DIR * d = opendir("/proc/self/fd");
    if (!d) {
        return inodes;
    }
    while (dirent * e = readdir(d)) {
        char path[64];
        char link[128];
        snprintf(path, sizeof(path), "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(path, link, sizeof(link) - 1);
        if (n <= 0) {
            continue;
        }
        link[n] = '\0';
        unsigned long inode = 0;
        if (sscanf(link, "socket:[%lu]", &inode) == 1) {
            inodes.insert(inode);
        }
    }
    closedir(d);
    return inodes;
}

// True when one of our sockets listens on `port` (IPv4 or IPv6).
bool listening(int port) {
    std::set<unsigned long> mine = own_socket_inodes();
    if (mine.empty()) {
        return false;
    }
    for (const char * table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
        std::ifstream f(table);
        std::string line;
        std::getline(f, line);  // header
        while (std::getline(f, line)) {
            std::istringstream in(line);
            std::string slot, local, remote, state, queues, timer, retr;
            unsigned long uid = 0, timeout = 0, inode = 0;
            if (!(in >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode)) {
                continue;
            }
            size_t colon = local.rfind(':');
            if (colon == std::string::npos || state != "0A") {  // 0A: TCP_LISTEN
                continue;
            }
            if (std::strtol(local.c_str() + colon + 1, nullptr, 16) == port && mine.count(inode)) {
                return true;
            }
        }
    }
    return false;
}

void usage(const char * argv0) {
    fprintf(stderr, "usage: %s [--host HOST] [--port PORT] [--threads N]\n", argv0);
}

}  // namespace

int main(int argc, char ** argv) {
    std::string host = "127.0.0.1";
    int port = 50052;
    int threads = std::max(1u, std::thread::hardware_concurrency() / 2);  // rpc-server's default
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if ((a == "--host" || a == "-H") && i + 1 < argc) {
            host = argv[++i];
        } else if ((a == "--port" || a == "-p") && i + 1 < argc) {
            port = std::atoi(argv[++i]);
        } else if ((a == "--threads" || a == "-t") && i + 1 < argc) {
            threads = std::atoi(argv[++i]);
        } else {
            usage(argv[0]);
            return 2;
        }
    }
    if (port <= 0 || port > 65535 || threads <= 0) {
        usage(argv[0]);
        return 2;
    }

    ggml_backend_load_all();  // no-op for a static build; kept so a GGML_BACKEND_DL build works too
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) {
        fprintf(stderr, "rpc_server: no CPU device\n");
        return 1;
    }
    std::string endpoint = host + ":" + std::to_string(port);

    std::thread([port, endpoint] {
        for (;;) {
            if (listening(port)) {
                printf("rpc_server: listening on %s\n", endpoint.c_str());
                fflush(stdout);
                return;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
    }).detach();

    // Blocks: accepts one client at a time, forever.
    ggml_backend_rpc_start_server(endpoint.c_str(), /*cache_dir=*/nullptr, (size_t) threads, 1, &cpu);
    fprintf(stderr, "rpc_server: the RPC server returned (could not listen on %s?)\n", endpoint.c_str());
    return 1;
}
