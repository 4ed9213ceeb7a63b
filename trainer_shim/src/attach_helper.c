// The helper that `rankscope attach --pid` loads into a live Python process (issue 10).
//
// The attaching side (rankscope/attach.py) stops the process with ptrace (gdb), and on a thread
// other than the main one: dlopen()s this library, looks up rankscope_attach_request with
// dlsym() and calls it with the path of a request file; then it detaches. Nothing here runs
// Python on that thread: rankscope_attach_request only copies the path into static storage and
// queues a pending call (Py_AddPendingCall may be called from any thread without the GIL). The
// interpreter runs the pending call on the main thread, at the next bytecode boundary, with the
// GIL held: never inside a C++ operator or autograd. The call runs rankscope._attach_payload on
// the request; it always returns 0 and clears any error, so that a failure is reported through
// the request's acknowledgement file and never reaches the interpreter as a failed pending call.
//
// Built against the stable ABI (Py_LIMITED_API): the symbols come from the interpreter the
// library is loaded into, whatever its minor version.

#define Py_LIMITED_API 0x03080000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdio.h>
#include <string.h>

#define RANKSCOPE_MAX_PATH 1024

// One request at a time: a second call before the first ran returns -2 (the caller retries).
static char g_request[RANKSCOPE_MAX_PATH];
static volatile int g_queued = 0;

// Request paths are made by the attaching side: /tmp/rankscope-attach-<hex>/request.json and the
// like. Anything outside [A-Za-z0-9/._-] is refused, so the path needs no quoting in Python.
static int valid_path(const char* path) {
  size_t n = strlen(path);
  if (n == 0 || n >= RANKSCOPE_MAX_PATH || path[0] != '/') return 0;
  for (size_t i = 0; i < n; ++i) {
    char c = path[i];
    int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
             c == '/' || c == '.' || c == '_' || c == '-';
    if (!ok) return 0;
  }
  return 1;
}

// Runs on the main thread with the GIL held. Always returns 0.
static int run_request(void* unused) {
  (void)unused;
  static char code[RANKSCOPE_MAX_PATH * 2 + 512];
  snprintf(code, sizeof(code),
           "def _rankscope_attach_bootstrap(path):\n"
           "    import json, sys\n"
           "    try:\n"
           "        with open(path) as f:\n"
           "            request = json.load(f)\n"
           "        for p in request.get('pythonpath', []):\n"
           "            if p not in sys.path:\n"
           "                sys.path.append(p)\n"
           "        from rankscope import _attach_payload\n"
           "        _attach_payload.run(request)\n"
           "    except BaseException as e:\n"
           "        try:\n"
           "            with open(path + '.failed', 'w') as f:\n"
           "                f.write(repr(e))\n"
           "        except BaseException:\n"
           "            pass\n"
           "_rankscope_attach_bootstrap('%s')\n",
           g_request);
  g_queued = 0;
  // exec(code, {}) in a fresh namespace: nothing is left behind in the target's modules.
  PyObject* builtins = PyImport_ImportModule("builtins");
  PyObject* exec = builtins ? PyObject_GetAttrString(builtins, "exec") : NULL;
  PyObject* globals = PyDict_New();
  PyObject* result = (exec && globals) ? PyObject_CallFunction(exec, "sO", code, globals) : NULL;
  Py_XDECREF(result);
  Py_XDECREF(globals);
  Py_XDECREF(exec);
  Py_XDECREF(builtins);
  if (PyErr_Occurred()) PyErr_Clear();
  return 0;
}

// Queues the request at `path` for the main thread. Returns 0 when queued, -1 for a bad path,
// -2 when a request is already queued, -3 when the interpreter's pending-call queue is full.
__attribute__((visibility("default"))) int rankscope_attach_request(const char* path) {
  if (!valid_path(path)) return -1;
  if (g_queued) return -2;
  memcpy(g_request, path, strlen(path) + 1);
  g_queued = 1;
  if (Py_AddPendingCall(run_request, NULL) != 0) {
    g_queued = 0;
    return -3;
  }
  return 0;
}
