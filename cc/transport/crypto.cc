#include "cc/transport/crypto.h"

#include <dlfcn.h>

#include <climits>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cc/transport/error_kinds.h"

namespace tf_rdma {
namespace {

// OpenSSL's types, opaque here as in its public API.
struct EVP_MD;
struct EVP_PKEY_CTX;
struct ENGINE;

// NID_hkdf in OpenSSL's obj_mac.h: a registered object id, fixed for good.
constexpr int kEvpPkeyHkdf = 1036;

// Every libcrypto function used, with OpenSSL 3's signatures.
// X(return type, name, parameters)
#define TF_RDMA_CRYPTO_FUNCTIONS(X)                                                                \
  X(const EVP_MD*, EVP_sha256, (void))                                                             \
  X(unsigned char*, HMAC,                                                                          \
    (const EVP_MD* md, const void* key, int key_length, const unsigned char* data,                 \
     size_t data_length, unsigned char* out, unsigned int* out_length))                            \
  X(int, EVP_Digest,                                                                               \
    (const void* data, size_t count, unsigned char* out, unsigned int* out_length,                 \
     const EVP_MD* md, ENGINE* engine))                                                            \
  X(int, RAND_bytes, (unsigned char* out, int length))                                             \
  X(int, CRYPTO_memcmp, (const void* a, const void* b, size_t length))                             \
  X(EVP_PKEY_CTX*, EVP_PKEY_CTX_new_id, (int id, ENGINE* engine))                                  \
  X(int, EVP_PKEY_derive_init, (EVP_PKEY_CTX * context))                                           \
  X(int, EVP_PKEY_CTX_set_hkdf_md, (EVP_PKEY_CTX * context, const EVP_MD* md))                     \
  X(int, EVP_PKEY_CTX_set1_hkdf_salt, (EVP_PKEY_CTX * context, const unsigned char* salt, int n))  \
  X(int, EVP_PKEY_CTX_set1_hkdf_key, (EVP_PKEY_CTX * context, const unsigned char* key, int n))    \
  X(int, EVP_PKEY_CTX_add1_hkdf_info, (EVP_PKEY_CTX * context, const unsigned char* info, int n))  \
  X(int, EVP_PKEY_derive, (EVP_PKEY_CTX * context, unsigned char* out, size_t* out_length))        \
  X(void, EVP_PKEY_CTX_free, (EVP_PKEY_CTX * context))

struct Libcrypto {
#define TF_RDMA_CRYPTO_POINTER(ret, name, params) ret(*name) params = nullptr;
  TF_RDMA_CRYPTO_FUNCTIONS(TF_RDMA_CRYPTO_POINTER)
#undef TF_RDMA_CRYPTO_POINTER
};

Libcrypto libcrypto;

constexpr char kInstallHint[] =
    "Install OpenSSL 3's runtime library: `apt-get install libssl3` (Debian, Ubuntu), "
    "`dnf install openssl-libs` (RHEL, Fedora)";

// RTLD_DEEPBIND: libcrypto calls its own exported functions through the dynamic linker, which
// looks in the global scope first. A process that loaded TensorFlow RTLD_GLOBAL (Python after
// sys.setdlopenflags(RTLD_GLOBAL), or a program linking libtensorflow_framework) has BoringSSL's
// functions of the same names there, and libcrypto would call those with its own structures and
// crash. DEEPBIND makes a libcrypto loaded here look in itself first. (Already loaded, by Python's
// hashlib say, it was bound when it loaded.) The sanitizers' runtimes refuse DEEPBIND: a checked
// build (-fsanitize=address or thread, tools/sanitizers) loads without it, and must not load
// TensorFlow RTLD_GLOBAL first. GCC says so by macros, clang 14 only by __has_feature.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TF_RDMA_SANITIZED_BUILD
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define TF_RDMA_SANITIZED_BUILD
#endif
#endif
#if defined(TF_RDMA_SANITIZED_BUILD)
constexpr int kOwnSymbolsFirst = 0;
#else
constexpr int kOwnSymbolsFirst = RTLD_DEEPBIND;
#endif

// libcrypto missing or unfit: FAILED_PRECONDITION (installing it is the fix), of its own kind so that
// it is not taken for a peer of another cluster.
absl::Status LibraryError(std::string message) {
  return WithErrorKind(absl::FailedPreconditionError(std::move(message)), ErrorKind::kMissingLibrary);
}

absl::Status Load() {
  void* handle = dlopen("libcrypto.so.3", RTLD_NOW | RTLD_LOCAL | kOwnSymbolsFirst);
  if (handle == nullptr) {
    return LibraryError(absl::StrCat(
        "tf_rdma needs OpenSSL's libcrypto.so.3 for its handshake and could not load it (",
        dlerror(), "). ", kInstallHint, "."));
  }
#define TF_RDMA_CRYPTO_RESOLVE(ret, name, params)                                                  \
  libcrypto.name = reinterpret_cast<ret(*) params>(dlsym(handle, #name));                          \
  if (libcrypto.name == nullptr) {                                                                 \
    return LibraryError(absl::StrCat(                                                           \
        "the libcrypto.so.3 loaded lacks " #name ", which tf_rdma's handshake needs. ",           \
        kInstallHint, "."));                                                                       \
  }
  TF_RDMA_CRYPTO_FUNCTIONS(TF_RDMA_CRYPTO_RESOLVE)
#undef TF_RDMA_CRYPTO_RESOLVE
  return absl::OkStatus();
}

// A known answer (RFC 4231 test case 2) and one use of each primitive, now: OpenSSL sets up its
// providers and random generator on first use, which must not happen first in a handshake (under
// a memory limit it could fail there, for every peer), and a broken library is found here.
absl::Status SelfTest() {
  const Sha256Digest expected = {0x5b, 0xdc, 0xc1, 0x46, 0xbf, 0x60, 0x75, 0x4e, 0x6a, 0x04, 0x24,
                                 0x26, 0x08, 0x95, 0x75, 0xc7, 0x5a, 0x00, 0x3f, 0x08, 0x9d, 0x27,
                                 0x39, 0x83, 0x9d, 0xec, 0x58, 0xb9, 0x64, 0xec, 0x38, 0x43};
  if (HmacSha256("Jefe", "what do ya want for nothing?") != expected) {
    return LibraryError(absl::StrCat(
        "the libcrypto.so.3 loaded computes HMAC-SHA-256 wrongly (RFC 4231 test case 2). ", kInstallHint, "."));
  }
  Sha256("");
  uint8_t bytes[32];
  absl::Status random = RandomBytes(bytes, sizeof(bytes));
  if (!random.ok()) return random;
  return HkdfSha256("secret", "salt", "info", bytes, sizeof(bytes));
}

bool FitsInt(size_t n) { return n <= static_cast<size_t>(INT_MAX); }

}  // namespace

absl::Status LoadCrypto() {
  static const absl::Status* loaded = [] {
    absl::Status status = Load();
    if (status.ok()) status = SelfTest();
    return new absl::Status(status);
  }();
  return *loaded;
}

void AppendLengthPrefixed(std::string& out, std::string_view field) {
  const uint32_t length = static_cast<uint32_t>(field.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  out.append(field);
}

Sha256Digest Sha256(std::string_view data) {
  Sha256Digest digest{};
  unsigned int length = 0;
  libcrypto.EVP_Digest(data.data(), data.size(), digest.data(), &length, libcrypto.EVP_sha256(), nullptr);
  return digest;
}

Sha256Digest HmacSha256(std::string_view key, std::string_view message) {
  Sha256Digest digest{};
  unsigned int length = 0;
  // Keys are cluster keys (32 bytes) and tests' short keys, far below INT_MAX.
  libcrypto.HMAC(libcrypto.EVP_sha256(), key.data(), static_cast<int>(key.size()),
                 reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest.data(),
                 &length);
  return digest;
}

absl::Status HkdfSha256(std::string_view secret, std::string_view salt, std::string_view info,
                        uint8_t* out, size_t length) {
  if (!FitsInt(secret.size()) || !FitsInt(salt.size()) || !FitsInt(info.size())) {
    return absl::InvalidArgumentError("HKDF input longer than OpenSSL takes");
  }
  EVP_PKEY_CTX* context = libcrypto.EVP_PKEY_CTX_new_id(kEvpPkeyHkdf, nullptr);
  if (context == nullptr) return absl::InternalError("OpenSSL could not create an HKDF context");
  size_t produced = length;
  const bool ok =
      libcrypto.EVP_PKEY_derive_init(context) > 0 &&
      libcrypto.EVP_PKEY_CTX_set_hkdf_md(context, libcrypto.EVP_sha256()) > 0 &&
      libcrypto.EVP_PKEY_CTX_set1_hkdf_salt(context, reinterpret_cast<const unsigned char*>(salt.data()),
                                            static_cast<int>(salt.size())) > 0 &&
      libcrypto.EVP_PKEY_CTX_set1_hkdf_key(context, reinterpret_cast<const unsigned char*>(secret.data()),
                                           static_cast<int>(secret.size())) > 0 &&
      libcrypto.EVP_PKEY_CTX_add1_hkdf_info(context, reinterpret_cast<const unsigned char*>(info.data()),
                                            static_cast<int>(info.size())) > 0 &&
      libcrypto.EVP_PKEY_derive(context, out, &produced) > 0 && produced == length;
  libcrypto.EVP_PKEY_CTX_free(context);
  if (!ok) return absl::InternalError(absl::StrCat("OpenSSL's HKDF-SHA-256 failed to derive ", length, " bytes"));
  return absl::OkStatus();
}

absl::Status RandomBytes(uint8_t* out, size_t length) {
  if (!FitsInt(length) || libcrypto.RAND_bytes(out, static_cast<int>(length)) != 1) {
    return absl::InternalError("OpenSSL's RAND_bytes failed: the system's random source is unavailable");
  }
  return absl::OkStatus();
}

bool DigestsEqual(const Sha256Digest& a, const Sha256Digest& b) {
  return libcrypto.CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace tf_rdma
