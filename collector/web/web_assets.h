// The web view's static files (collector/web/), built into the binary: tools/embed_web_assets.cmake
// turns each file into bytes of the generated web_assets.cc, so the collector needs no files and
// no network at run time.
//
// Thread-safe (immutable data).
#ifndef RANKSCOPE_COLLECTOR_WEB_WEB_ASSETS_H_
#define RANKSCOPE_COLLECTOR_WEB_WEB_ASSETS_H_

#include "absl/strings/string_view.h"

namespace rankscope::collector {

struct WebAsset {
  absl::string_view name;          // file name under collector/web/, e.g. "app.js"
  absl::string_view content_type;  // from the file's extension
  absl::string_view body;
};

// The asset named `name` (a file name under collector/web/), or nullptr.
const WebAsset* FindWebAsset(absl::string_view name);

}  // namespace rankscope::collector

#endif  // RANKSCOPE_COLLECTOR_WEB_WEB_ASSETS_H_
