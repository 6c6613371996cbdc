//! Templates built through E2B's template API: names, builds and tags as
//! the E2B gateway keeps them. A ready build is a Cairn image plus the
//! [`ImageConfig`] its sandboxes start with. Schema and durability notes:
//! `migrations/sqlite/0017_e2b_templates.sql`.

pub use cairn_engine::state::e2b_templates::*;

use cairn_engine::state::ImageConfig;
use cairn_engine::{Engine, EngineError};

/// The gateway's templates: names, builds and tags.
pub trait E2bTemplateBook {
    fn start_e2b_template_build(
        &self,
        name: &str,
        new_id: &str,
        build_id: &str,
        tags: &[String],
    ) -> Result<E2bTemplate, EngineError>;

    fn e2b_template(&self, key: &str) -> Result<Option<E2bTemplate>, EngineError>;

    fn e2b_template_build(&self, id: &str) -> Result<Option<TemplateBuild>, EngineError>;

    fn unfinished_e2b_template_builds(&self) -> Result<Vec<TemplateBuild>, EngineError>;

    fn claim_e2b_template_build(&self, id: &str) -> Result<bool, EngineError>;

    fn finish_e2b_template_build(
        &self,
        build: &TemplateBuild,
        outcome: Result<(&str, &ImageConfig), &BuildFailure>,
        logs: &[BuildLogLine],
    ) -> Result<(), EngineError>;

    fn e2b_template_tags(&self, template_id: &str) -> Result<Vec<TemplateTag>, EngineError>;

    fn tag_e2b_template_build(&self, template_id: &str, build_id: &str, tags: &[String]) -> Result<(), EngineError>;

    fn untag_e2b_template(&self, template_id: &str, tags: &[String]) -> Result<u64, EngineError>;

    /// Forgets a template and removes the images its builds made (a
    /// sandbox running one keeps its layers).
    fn delete_e2b_template(&mut self, template_id: &str) -> Result<(), EngineError>;
}

impl E2bTemplateBook for Engine {
    fn start_e2b_template_build(
        &self,
        name: &str,
        new_id: &str,
        build_id: &str,
        tags: &[String],
    ) -> Result<E2bTemplate, EngineError> {
        Ok(self
            .db()
            .start_e2b_template_build(name, new_id, build_id, tags, cairn_engine::now_ms())?)
    }

    fn e2b_template(&self, key: &str) -> Result<Option<E2bTemplate>, EngineError> {
        Ok(self.db().e2b_template(key)?)
    }

    fn e2b_template_build(&self, id: &str) -> Result<Option<TemplateBuild>, EngineError> {
        Ok(self.db().e2b_template_build(id)?)
    }

    fn unfinished_e2b_template_builds(&self) -> Result<Vec<TemplateBuild>, EngineError> {
        Ok(self.db().unfinished_e2b_template_builds()?)
    }

    fn claim_e2b_template_build(&self, id: &str) -> Result<bool, EngineError> {
        Ok(self.db().claim_e2b_template_build(id)?)
    }

    fn finish_e2b_template_build(
        &self,
        build: &TemplateBuild,
        outcome: Result<(&str, &ImageConfig), &BuildFailure>,
        logs: &[BuildLogLine],
    ) -> Result<(), EngineError> {
        Ok(self
            .db()
            .finish_e2b_template_build(build, outcome, logs, cairn_engine::now_ms())?)
    }

    fn e2b_template_tags(&self, template_id: &str) -> Result<Vec<TemplateTag>, EngineError> {
        Ok(self.db().e2b_template_tags(template_id)?)
    }

    fn tag_e2b_template_build(&self, template_id: &str, build_id: &str, tags: &[String]) -> Result<(), EngineError> {
        Ok(self
            .db()
            .tag_e2b_template_build(template_id, build_id, tags, cairn_engine::now_ms())?)
    }

    fn untag_e2b_template(&self, template_id: &str, tags: &[String]) -> Result<u64, EngineError> {
        Ok(self.db().untag_e2b_template(template_id, tags)?)
    }

    fn delete_e2b_template(&mut self, template_id: &str) -> Result<(), EngineError> {
        let images = self.db().delete_e2b_template(template_id)?;
        // The template was the caller's to delete: its builds' images go
        // with it, by their stored names, whoever's engine built them.
        self.as_administrator(|e| {
            for image in images {
                match e.remove_image(&image) {
                    Ok(()) => {}
                    Err(EngineError::Image(cairn_engine::images::ImageError::NotFound(_))) => {}
                    Err(err) => return Err(err),
                }
            }
            Ok(())
        })
    }
}
