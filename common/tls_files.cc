#include "common/tls_files.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace rankscope::tls {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
using X509Ptr = std::unique_ptr<X509, X509Free>;
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;

BioPtr MemBio(const std::string& pem) {
  return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& name) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read ", name, " ", path, ": ", std::strerror(errno)));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (ss.str().empty())
    return absl::InvalidArgumentError(absl::StrCat(name, " ", path, " is empty"));
  return ss.str();
}

// The first certificate of a PEM text, or null; counts them in *count.
X509Ptr ParseCertificates(const std::string& pem, int* count) {
  BioPtr bio = MemBio(pem);
  X509Ptr first;
  *count = 0;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) {
    if (first == nullptr) {
      first.reset(x);
    } else {
      X509_free(x);
    }
    ++*count;
  }
  ERR_clear_error();  // the end of the text reads as an error
  return first;
}

absl::Status NotCertificates(const std::string& name, const std::string& path) {
  return absl::InvalidArgumentError(absl::StrCat(
      name, " ", path, " holds no PEM certificate (expected '-----BEGIN CERTIFICATE-----')"));
}

}  // namespace

absl::StatusOr<PemMaterial> LoadPemFiles(const PemPaths& paths) {
  if (paths.cert_file.empty() != paths.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(paths.cert_name, " and ", paths.key_name,
                                                   " go together: give both or neither"));
  }
  PemMaterial m;
  if (!paths.ca_file.empty()) {
    auto ca = ReadFile(paths.ca_file, paths.ca_name);
    if (!ca.ok()) return ca.status();
    int count = 0;
    if (ParseCertificates(*ca, &count) == nullptr)
      return NotCertificates(paths.ca_name, paths.ca_file);
    m.ca = std::move(*ca);
  }
  if (paths.cert_file.empty()) return m;

  auto cert = ReadFile(paths.cert_file, paths.cert_name);
  if (!cert.ok()) return cert.status();
  auto key = ReadFile(paths.key_file, paths.key_name);
  if (!key.ok()) return key.status();
  int count = 0;
  X509Ptr leaf = ParseCertificates(*cert, &count);
  if (leaf == nullptr) return NotCertificates(paths.cert_name, paths.cert_file);
  BioPtr key_bio = MemBio(*key);
  PkeyPtr pkey(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  ERR_clear_error();
  if (pkey == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(paths.key_name, " ", paths.key_file,
                     " holds no unencrypted PEM private key (expected '-----BEGIN PRIVATE "
                     "KEY-----' or '-----BEGIN RSA/EC PRIVATE KEY-----')"));
  }
  if (X509_check_private_key(leaf.get(), pkey.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(paths.key_name, " ", paths.key_file,
                                                   " is not the private key of the certificate in ",
                                                   paths.cert_name, " ", paths.cert_file));
  }
  m.cert = std::move(*cert);
  m.key = std::move(*key);
  return m;
}

}  // namespace rankscope::tls
