//! Guest images.
