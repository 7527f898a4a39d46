/* Stand-in for Huawei securec (libc_sec.so): public semantics of the *_s functions. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <stddef.h>
#define EOK 0
#define SEC_EINVAL 22
#define SEC_ERANGE 34
#define SEC_EOVERLAP 54

int memcpy_s(void *dest, size_t destMax, const void *src, size_t count) {
  if (count == 0) return EOK;
  if (dest == NULL || src == NULL) return SEC_EINVAL;
  if (count > destMax) { if (dest && destMax) memset(dest, 0, destMax); return SEC_ERANGE; }
  memmove(dest, src, count);
  return EOK;
}
int memmove_s(void *dest, size_t destMax, const void *src, size_t count) {
  if (count == 0) return EOK;
  if (dest == NULL || src == NULL) return SEC_EINVAL;
  if (count > destMax) return SEC_ERANGE;
  memmove(dest, src, count);
  return EOK;
}
int memset_s(void *dest, size_t destMax, int c, size_t count) {
  if (count == 0) return EOK;
  if (dest == NULL) return SEC_EINVAL;
  if (count > destMax) { memset(dest, c, destMax); return SEC_ERANGE; }
  memset(dest, c, count);
  return EOK;
}
int strcpy_s(char *dest, size_t destMax, const char *src) {
  if (dest == NULL || destMax == 0) return SEC_EINVAL;
  if (src == NULL) { dest[0] = 0; return SEC_EINVAL; }
  size_t n = strlen(src);
  if (n + 1 > destMax) { dest[0] = 0; return SEC_ERANGE; }
  memmove(dest, src, n + 1);
  return EOK;
}
int strncpy_s(char *dest, size_t destMax, const char *src, size_t count) {
  if (dest == NULL || destMax == 0) return SEC_EINVAL;
  if (src == NULL) { dest[0] = 0; return SEC_EINVAL; }
  size_t n = strnlen(src, count);
  if (n + 1 > destMax) { dest[0] = 0; return SEC_ERANGE; }
  memmove(dest, src, n);
  dest[n] = 0;
  return EOK;
}
int strcat_s(char *dest, size_t destMax, const char *src) {
  if (dest == NULL || destMax == 0 || src == NULL) return SEC_EINVAL;
  size_t d = strnlen(dest, destMax), n = strlen(src);
  if (d + n + 1 > destMax) { dest[0] = 0; return SEC_ERANGE; }
  memmove(dest + d, src, n + 1);
  return EOK;
}
int strncat_s(char *dest, size_t destMax, const char *src, size_t count) {
  if (dest == NULL || destMax == 0 || src == NULL) return SEC_EINVAL;
  size_t d = strnlen(dest, destMax), n = strnlen(src, count);
  if (d + n + 1 > destMax) { dest[0] = 0; return SEC_ERANGE; }
  memmove(dest + d, src, n);
  dest[d + n] = 0;
  return EOK;
}
int vsnprintf_s(char *dest, size_t destMax, size_t count, const char *format, va_list ap) {
  if (dest == NULL || format == NULL || destMax == 0) return -1;
  size_t lim = count < destMax - 1 ? count + 1 : destMax;
  int r = vsnprintf(dest, lim, format, ap);
  if (r < 0) { dest[0] = 0; return -1; }
  if ((size_t)r >= lim) { /* truncated */ return (count < destMax - 1) ? (int)count : -1; }
  return r;
}
int snprintf_s(char *dest, size_t destMax, size_t count, const char *format, ...) {
  va_list ap; va_start(ap, format);
  int r = vsnprintf_s(dest, destMax, count, format, ap);
  va_end(ap);
  return r;
}
int vsprintf_s(char *dest, size_t destMax, const char *format, va_list ap) {
  if (dest == NULL || format == NULL || destMax == 0) return -1;
  int r = vsnprintf(dest, destMax, format, ap);
  if (r < 0 || (size_t)r >= destMax) { dest[0] = 0; return -1; }
  return r;
}
int sprintf_s(char *dest, size_t destMax, const char *format, ...) {
  va_list ap; va_start(ap, format);
  int r = vsprintf_s(dest, destMax, format, ap);
  va_end(ap);
  return r;
}
int vsnprintf_truncated_s(char *dest, size_t destMax, const char *format, va_list ap) {
  if (dest == NULL || format == NULL || destMax == 0) return -1;
  int r = vsnprintf(dest, destMax, format, ap);
  if (r < 0) { dest[0] = 0; return -1; }
  if ((size_t)r >= destMax) return (int)(destMax - 1);
  return r;
}
int snprintf_truncated_s(char *dest, size_t destMax, const char *format, ...) {
  va_list ap; va_start(ap, format);
  int r = vsnprintf_truncated_s(dest, destMax, format, ap);
  va_end(ap);
  return r;
}
int vsscanf_s(const char *buffer, const char *format, va_list ap) { return vsscanf(buffer, format, ap); }
int sscanf_s(const char *buffer, const char *format, ...) {
  va_list ap; va_start(ap, format);
  int r = vsscanf(buffer, format, ap);
  va_end(ap);
  return r;
}
