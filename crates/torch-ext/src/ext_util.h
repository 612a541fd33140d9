// Error reporting shared by the extension's C entry points: every extern "C" function runs its
// body through `guarded`, which turns a C++ exception into a heap string (freed by the caller with
// vt_free_error) and success into null, so no exception ever unwinds into Rust.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace vt_util {

inline char* error_string(const std::string& message) {
  char* out = static_cast<char*>(std::malloc(message.size() + 1));
  if (out != nullptr) std::memcpy(out, message.c_str(), message.size() + 1);
  return out;
}

template <typename F>
char* guarded(F&& f) {
  try {
    f();
    return nullptr;
  } catch (const c10::Error& e) {
    return error_string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return error_string(e.what());
  } catch (...) {
    return error_string("unknown C++ exception");
  }
}

}  // namespace vt_util
