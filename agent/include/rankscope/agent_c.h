/* rankscope agent: C API over rankscope::Agent and rankscope::CountSketch, for other languages.
 *
 * Every function returning int returns 0 on success or an absl::StatusCode value on failure;
 * functions taking `char* err, size_t err_len` write a NUL-terminated message there on failure
 * (err may be NULL). Handles are not thread-safe except where the C++ class is (see agent.h). */
#ifndef RANKSCOPE_AGENT_C_H_
#define RANKSCOPE_AGENT_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RANKSCOPE_DTYPE_FLOAT32 0
#define RANKSCOPE_DTYPE_BFLOAT16 1
#define RANKSCOPE_DTYPE_FLOAT16 2

typedef struct rankscope_agent rankscope_agent;
typedef struct rankscope_sketch rankscope_sketch;

typedef struct {
  const char* collector_address; /* default "127.0.0.1:50051" */
  const char* job;               /* required */
  uint32_t rank;
  uint32_t world_size;
  uint32_t sketch_dim; /* default 1024 */
  uint64_t sketch_seed;
  uint32_t attempt;
  const char* host;              /* may be NULL */
  const char* framework_version; /* may be NULL */
  const char* auth_token;        /* may be NULL */
  size_t queue_capacity;         /* default 1024 */
  size_t max_unacked;            /* default 8192 */
  /* TLS (rankscope::ClientTlsOptions); each may be NULL. Plaintext unless a CA, cert or key is
   * given; the files are read and checked by rankscope_agent_create. */
  const char* tls_ca_file;     /* PEM CA that signs the collector's certificate */
  const char* tls_cert_file;   /* PEM client certificate, for mutual TLS */
  const char* tls_key_file;    /* its PEM private key */
  const char* tls_target_name; /* name to verify in the collector's certificate */
} rankscope_agent_options;

typedef struct {
  uint64_t recorded, sent, acked, rejected, dropped, invalid, reconnects;
  int connected;
  size_t queued, unacked;
} rankscope_agent_stats;

/* Fills *options with the defaults of rankscope::AgentOptions. */
void rankscope_agent_options_init(rankscope_agent_options* options);

int rankscope_agent_create(const rankscope_agent_options* options, rankscope_agent** out, char* err,
                           size_t err_len);
/* Optional fields: pass NULL / negative to omit (fingerprints: has_* flags). */
int rankscope_agent_record(rankscope_agent* agent, uint64_t step, double loss, double grad_norm,
                           const float* sketch, size_t sketch_len);
int rankscope_agent_record_ext(rankscope_agent* agent, uint64_t step, double loss, double grad_norm,
                               const float* sketch, size_t sketch_len,
                               int has_reduced_grad_fingerprint, uint64_t reduced_grad_fingerprint,
                               int has_param_fingerprint, uint64_t param_fingerprint,
                               double reduced_grad_norm /* <0: absent */,
                               double step_time_seconds /* <0: absent */,
                               uint32_t local_batch_size);
int rankscope_agent_flush(rankscope_agent* agent, double timeout_seconds, char* err,
                          size_t err_len);
int rankscope_agent_close(rankscope_agent* agent, double timeout_seconds, char* err,
                          size_t err_len);
void rankscope_agent_stats_get(const rankscope_agent* agent, rankscope_agent_stats* out);
/* Writes the newest stream failure (AgentStats::last_error, "" when none) to buf, NUL-terminated
 * and truncated to buf_len - 1 bytes; returns its full length. */
size_t rankscope_agent_last_error(const rankscope_agent* agent, char* buf, size_t buf_len);
/* Returns 1 and fills the fields if a control message was received, else 0. */
int rankscope_agent_control(const rankscope_agent* agent, uint64_t* generation,
                            uint64_t* apply_at_step, int* enabled, uint32_t* every,
                            uint32_t* sketch_dim);
/* Closes with a zero timeout if needed, then frees. NULL is allowed. */
void rankscope_agent_destroy(rankscope_agent* agent);

rankscope_sketch* rankscope_sketch_create(uint32_t dim, uint64_t seed);
void rankscope_sketch_reset(rankscope_sketch* sketch);
/* Adds n values of type dtype as coordinates [offset, offset + n). Returns 0 or an error code. */
int rankscope_sketch_add(rankscope_sketch* sketch, const void* data, int dtype, size_t n,
                         uint64_t offset);
/* Writes dim() floats to out. */
void rankscope_sketch_values(const rankscope_sketch* sketch, float* out);
double rankscope_sketch_sum_squares(const rankscope_sketch* sketch);
uint32_t rankscope_sketch_dim(const rankscope_sketch* sketch);
void rankscope_sketch_destroy(rankscope_sketch* sketch);

#ifdef __cplusplus
}
#endif

#endif /* RANKSCOPE_AGENT_C_H_ */
