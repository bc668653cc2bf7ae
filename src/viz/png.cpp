// PNG encoding and decoding through libpng, in memory; files written atomically.
#include <png.h>

#include <cstring>

#include "mha/errors.h"
#include "mha/io/safetensors.h"
#include "mha/viz/image.h"

namespace mha::viz {

namespace {

[[noreturn]] void png_fail(png_structp, png_const_charp message) {
  throw FormatError(std::string("[mha::viz::png] ") + message);
}
void png_warn(png_structp, png_const_charp) {}

struct Reader {
  const std::string& bytes;
  size_t pos = 0;
};

}  // namespace

void Image::set(int64_t x, int64_t y, uint8_t r, uint8_t g, uint8_t b) {
  if (x < 0 || y < 0 || x >= width || y >= height) return;
  uint8_t* p = &rgb[size_t((y * width + x) * 3)];
  p[0] = r, p[1] = g, p[2] = b;
}

std::string encode_png(const Image& image) {
  std::string out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, png_fail, png_warn);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!png || !info) {
    png_destroy_write_struct(&png, &info);
    throw FormatError("[mha::viz::encode_png] libpng: out of memory");
  }
  try {
    png_set_write_fn(
        png, &out,
        [](png_structp p, png_bytep data, png_size_t n) {
          static_cast<std::string*>(png_get_io_ptr(p))->append(reinterpret_cast<const char*>(data), n);
        },
        [](png_structp) {});
    png_set_IHDR(png, info, png_uint_32(image.width), png_uint_32(image.height), 8, PNG_COLOR_TYPE_RGB,
                 PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    for (int64_t y = 0; y < image.height; ++y)
      png_write_row(png, const_cast<png_bytep>(image.rgb.data() + size_t(y * image.width * 3)));
    png_write_end(png, nullptr);
  } catch (...) {
    png_destroy_write_struct(&png, &info);
    throw;
  }
  png_destroy_write_struct(&png, &info);
  return out;
}

Image decode_png(const std::string& bytes) {
  if (bytes.size() < 8 || png_sig_cmp(reinterpret_cast<png_const_bytep>(bytes.data()), 0, 8) != 0)
    throw FormatError("[mha::viz::decode_png] bytes: expected a PNG signature; got something else");
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, nullptr, png_fail, png_warn);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  Reader reader{bytes};
  Image image;
  try {
    png_set_read_fn(png, &reader, [](png_structp p, png_bytep data, png_size_t n) {
      Reader& r = *static_cast<Reader*>(png_get_io_ptr(p));
      if (r.pos + n > r.bytes.size()) png_error(p, "truncated PNG");
      std::memcpy(data, r.bytes.data() + r.pos, n);
      r.pos += n;
    });
    png_read_info(png, info);
    png_set_strip_16(png);
    png_set_palette_to_rgb(png);
    png_set_gray_to_rgb(png);
    png_set_strip_alpha(png);
    png_read_update_info(png, info);
    image = Image(int64_t(png_get_image_width(png, info)), int64_t(png_get_image_height(png, info)));
    if (png_get_rowbytes(png, info) != size_t(image.width * 3)) png_error(png, "unsupported PNG layout");
    for (int64_t y = 0; y < image.height; ++y) png_read_row(png, image.rgb.data() + size_t(y * image.width * 3), nullptr);
  } catch (...) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw;
  }
  png_destroy_read_struct(&png, &info, nullptr);
  return image;
}

void save_png(const std::string& path, const Image& image) { io::write_file_atomically(path, encode_png(image)); }

}  // namespace mha::viz
